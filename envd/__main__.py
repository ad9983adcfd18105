"""`python -m envd`: serve envd on a unix socket.

The token comes from ENVD_TOKEN and is removed from the environment, so no process envd starts inherits it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys

from envd.server import EnvdConfig, serve


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, configure logging, and serve until SIGTERM/SIGINT."""
    p = argparse.ArgumentParser(prog="envd", description=__doc__)
    p.add_argument("--socket", default="/run/envd/envd.sock", help="unix socket path to serve on")
    p.add_argument("--workspace", default="/workspace", help="default cwd and base of relative paths")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="envd %(levelname)s %(message)s")
    token = os.environ.pop("ENVD_TOKEN", "")
    if not token:
        sys.exit("envd: ENVD_TOKEN is not set; refusing to serve without a token")
    defaults = EnvdConfig(socket_path=args.socket, token=token, workspace=args.workspace)
    # the container's environment (image ENV and the sandbox spec's env) is the base of every process's environment
    cfg = dataclasses.replace(defaults, base_env={**defaults.base_env, **os.environ})
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
