"""`python -m envd`: serve envd on a unix socket.

The token comes from ENVD_TOKEN and is removed from the environment, so no process envd starts inherits it.
Options are parsed by hand: argparse (with gettext) would add about 0.6 MB of private memory to every sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys

from envd.server import EnvdConfig, serve

USAGE = """usage: envd [--socket PATH] [--workspace DIR] [--log-level LEVEL]

  --socket PATH      unix socket path to serve on (default /run/envd/envd.sock)
  --workspace DIR    default cwd and base of relative paths (default /workspace)
  --log-level LEVEL  logging level (default WARNING)"""


def parse_options(argv: list[str]) -> dict[str, str]:
    """`--name value` or `--name=value` pairs over the defaults; exits with the usage on anything else."""
    opts = {"socket": "/run/envd/envd.sock", "workspace": "/workspace", "log-level": "WARNING"}
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print(USAGE)
            sys.exit(0)
        name, eq, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or name not in opts:
            sys.exit(f"envd: unknown argument {arg!r}\n{USAGE}")
        if not eq:
            value = next(args, "")
        if not value:
            sys.exit(f"envd: {arg} needs a value\n{USAGE}")
        opts[name] = value
    return opts


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, configure logging, and serve until SIGTERM/SIGINT."""
    opts = parse_options(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=opts["log-level"], stream=sys.stderr, format="envd %(levelname)s %(message)s")
    token = os.environ.pop("ENVD_TOKEN", "")
    if not token:
        sys.exit("envd: ENVD_TOKEN is not set; refusing to serve without a token")
    defaults = EnvdConfig(socket_path=opts["socket"], token=token, workspace=opts["workspace"])
    # the container's environment (image ENV and the sandbox spec's env) is the base of every process's environment
    cfg = dataclasses.replace(defaults, base_env={**defaults.base_env, **os.environ})
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
