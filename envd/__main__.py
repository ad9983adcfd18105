"""`python -m envd`: serve envd on a unix socket.

The token comes in a file the host wrote (by default `token` beside the socket, in the per-sandbox directory):
envd reads and unlinks it before it listens or runs anything, and never takes it from its environment, which
init and every process can read. envd then makes itself non-dumpable (no ptrace, no /proc/<envd>/mem or environ
for the sandbox's processes, which share its uid) and the sub-reaper of what it starts.
Options are parsed by hand: argparse (with gettext) would add about 0.6 MB of private memory to every sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys

from envd.kernel import become_subreaper, guard_limits, ignore_signals, make_non_dumpable
from envd.server import EnvdConfig, serve

TOKEN_VAR = "ENVD_TOKEN"
USAGE = """usage: envd [--socket PATH] [--token-file PATH] [--workspace DIR] [--log-level LEVEL]

  --socket PATH      unix socket path to serve on (default /run/envd/envd.sock)
  --token-file PATH  the sandbox token, read then removed (default: token beside the socket)
  --workspace DIR    default cwd and base of relative paths (default /workspace)
  --log-level LEVEL  logging level (default WARNING)"""


def parse_options(argv: list[str]) -> dict[str, str]:
    """`--name value` or `--name=value` pairs over the defaults; exits with the usage on anything else."""
    opts = {"socket": "/run/envd/envd.sock", "token-file": "", "workspace": "/workspace", "log-level": "WARNING"}
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


def take_token(path: str) -> str:
    """Read the token file and remove it (never following a link): nothing after envd can read it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        token = os.read(fd, 4096).decode().strip()
    finally:
        os.close(fd)
    os.unlink(path)
    return token


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, configure logging, and serve until SIGTERM/SIGINT (as PID 1: until the container goes)."""
    opts = parse_options(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=opts["log-level"], stream=sys.stderr, format="envd %(levelname)s %(message)s")
    token_file = opts["token-file"] or os.path.join(os.path.dirname(opts["socket"]), "token")
    try:
        token = take_token(token_file)
    except OSError as e:
        sys.exit(f"envd: cannot take the token from {token_file}: {e.strerror}; refusing to serve without a token")
    if not token:
        sys.exit(f"envd: {token_file} is empty; refusing to serve without a token")
    make_non_dumpable()
    try:
        guard_limits()
    except OSError as e:
        sys.exit(f"envd: cannot keep the sandbox's processes from setting each other's limits: {e}")
    if os.getpid() == 1:
        ignore_signals()
    subreaper = become_subreaper()
    defaults = EnvdConfig(socket_path=opts["socket"], token=token, workspace=opts["workspace"], subreaper=subreaper)
    # the container's environment (image ENV and the sandbox spec's env) is the base of every process's environment;
    # a variable named like the old token carrier is dropped, so nothing can pass for it
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}
    cfg = dataclasses.replace(defaults, base_env={**defaults.base_env, **env})
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
