"""`envfleet serve --openenv-port P` and `envfleet openenv --server HOST:PORT --port P`: sessions over OpenEnv."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

from pydantic import ValidationError

from orchestrator.cli.errors import CommandLineError
from orchestrator.cli.remote import add_client_arguments
from orchestrator.client.auth import ClientTLS
from orchestrator.core.errors import ConfigError
from orchestrator.openenv.config import OpenEnvConfig, check_facade_host

EXTRA_HINT = "the OpenEnv facade needs the openenv extra: pip install 'envfleet[openenv]'"


def add_openenv_arguments(serve: argparse.ArgumentParser) -> None:
    """`serve --openenv-port/--openenv-host`."""
    serve.add_argument(
        "--openenv-port", type=int, default=-1, help="serve sessions over OpenEnv on this port (0: a free one); -1: off"
    )
    serve.add_argument(
        "--openenv-host", default="127.0.0.1", help="where OpenEnv listens (plain HTTP: loopback unless --insecure)"
    )


def openenv_settings(args: argparse.Namespace) -> dict[str, object]:
    """The OrchestratorConfig field of the OpenEnv flags."""
    if args.openenv_port < 0:
        return {}
    _check_extra()
    return {"openenv": OpenEnvConfig(host=args.openenv_host, port=args.openenv_port)}


def _check_extra() -> None:
    import importlib.util

    if importlib.util.find_spec("openenv") is None:
        raise ConfigError(EXTRA_HINT)


def _read(flag: str, path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CommandLineError(f"cannot read {flag} {path}: {e.strerror or e}") from None


def _cmd_openenv(args: argparse.Namespace) -> int:
    _check_extra()
    from orchestrator.openenv.serving import start_facade

    try:
        config = OpenEnvConfig(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes)
    except ValidationError as e:
        raise CommandLineError(f"envfleet openenv: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None
    check_facade_host(config.host, args.insecure)
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = ClientTLS(
            _read("--tls-ca", args.tls_ca), _read("--tls-cert", args.tls_cert), _read("--tls-key", args.tls_key)
        )
    token = (_read("--token-file", args.token_file) or b"").decode().strip() or os.environ.get("ENVFLEET_TOKEN")

    async def go() -> None:
        facade = await start_facade(config, args.server, tls=tls, insecure=args.insecure, token=token or None)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"openenv {facade.url}/envs/ (in front of {args.server})", flush=True)
        if token:
            print("callers that send no token act with yours (loopback only)", flush=True)
        try:
            await stop.wait()
        finally:
            await facade.close()

    asyncio.run(go())
    return 0


def add_openenv_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`envfleet openenv`. Callers' own bearer tokens go through to the orchestrator; --token-file (or
    $ENVFLEET_TOKEN) is the token of callers that send none, for a facade on loopback in front of a remote server.
    --insecure also allows listening off loopback (plain HTTP)."""
    p = sub.add_parser(
        "openenv", help="serve a running orchestrator's environments over OpenEnv (reset/step over a websocket)"
    )
    add_client_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="where OpenEnv listens (plain HTTP: loopback unless --insecure)")
    p.add_argument("--port", type=int, default=8000, help="0: a free port")
    p.add_argument("--max-message-bytes", type=int, default=1 << 20, help="largest websocket frame a client may send")
    p.set_defaults(fn=_cmd_openenv)
