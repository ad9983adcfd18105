"""The command line's security and client parts: `serve`'s TLS/token flags, and the one way every client command
reaches a server (`--server ADDR` plus the token and TLS flags), falling back to something local only without it."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from orchestrator.cli.errors import CommandLineError
from orchestrator.client.auth import ClientTLS
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.server.security import SecurityConfig, TLSConfig, WorkerTLSConfig

DEFAULT_SERVER = "127.0.0.1:50051"


def add_serve_security_arguments(p: argparse.ArgumentParser) -> None:
    """TLS, tokens and reflection flags of `envfleet serve`."""
    p.add_argument("--token-file", help="YAML mapping bearer tokens to tenants; without it: no auth, loopback only")
    p.add_argument("--tls-cert", help="server certificate (PEM); with --tls-key, serve TLS")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mTLS)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback address without --token-file (anyone is tenant 'local') or without TLS",
    )
    p.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gRPC server reflection (default: on without TLS, off with TLS)",
    )
    # the worker wire's TCP listener (--worker-listen) serves TLS with --tls-cert/--tls-key whenever they are given
    p.add_argument(
        "--worker-tls-client-ca", help="require worker certificates signed by this CA on --worker-listen (mTLS)"
    )
    p.add_argument("--worker-tls-ca", help="the CA Ray workers verify this server by (PEM; default: system roots)")
    p.add_argument("--worker-tls-cert", help="the certificate Ray workers present, with --worker-tls-client-ca (PEM)")
    p.add_argument("--worker-tls-key", help="the private key of --worker-tls-cert (PEM)")
    p.add_argument("--session-ttl", type=float, default=600.0, help="seconds an idle session lives")
    p.add_argument(
        "--allow-policy-url",
        action="append",
        metavar="PREFIX",
        help="a URL prefix jobs' policies may be served under (repeatable; host may start with '*.'); default: any",
    )
    p.add_argument(
        "--replay-reference",
        choices=["owner", "all"],
        default="owner",
        help="who may run jobs on replay://reference, which streams each task's reference solution: the tenant that "
        "registered the environment (owner), or any tenant that sees it (all); a server without tokens allows it",
    )


def security_config(args: argparse.Namespace) -> SecurityConfig:
    """The SecurityConfig the serve flags ask for."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("envfleet serve: --tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise SystemExit("envfleet serve: --tls-client-ca needs --tls-cert and --tls-key")
    tls = (
        TLSConfig(
            cert_file=Path(args.tls_cert),
            key_file=Path(args.tls_key),
            client_ca_file=Path(args.tls_client_ca) if args.tls_client_ca else None,
        )
        if args.tls_cert
        else None
    )
    try:
        return SecurityConfig(
            token_file=Path(args.token_file) if args.token_file else None,
            tls=tls,
            insecure=args.insecure,
            policy_urls=getattr(args, "allow_policy_url", None),
            replay_reference=getattr(args, "replay_reference", "owner"),
        )
    except ValueError as e:
        raise SystemExit(f"envfleet serve: {e}") from None


def worker_tls_config(args: argparse.Namespace) -> WorkerTLSConfig:
    """The WorkerTLSConfig the serve flags ask for (Ray workers get the files' bytes at start)."""
    files = (args.worker_tls_client_ca, args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key)
    try:
        return WorkerTLSConfig(**dict(zip(("client_ca_file", "ca_file", "cert_file", "key_file"), files, strict=True)))
    except ValueError as e:
        raise SystemExit(f"envfleet serve: {e}") from None


def add_client_arguments(
    p: argparse.ArgumentParser, server_default: str | None = DEFAULT_SERVER, server_help: str = ""
) -> None:
    """How a client command reaches a server: the same flags on every command that can talk to one."""
    p.add_argument("--server", default=server_default, help=server_help or f"orchestrator address ({server_default})")
    p.add_argument("--token-file", help="a file holding your bearer token (default: $ENVFLEET_TOKEN)")
    p.add_argument("--tls-ca", help="CA certificate to trust (PEM); turns TLS on")
    p.add_argument("--tls-cert", help="client certificate (PEM), for mTLS")
    p.add_argument("--tls-key", help="client private key (PEM), for mTLS")
    p.add_argument("--insecure", action="store_true", help="allow sending the token in clear to a remote server")


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise CommandLineError(f"cannot read {flag} {path}: {e.strerror or e}") from None


def connect(args: argparse.Namespace) -> EnvfleetClient:
    """An EnvfleetClient for the client flags (the token from --token-file, else $ENVFLEET_TOKEN).

    CommandLineError (exit 2) for an unreadable file or a token that would go out in clear."""
    token = _read("--token-file", args.token_file).decode().strip() if args.token_file else None
    token = token or os.environ.get("ENVFLEET_TOKEN")
    tls = None
    if args.tls_ca or args.tls_cert:
        files = (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key))
        tls = ClientTLS(*(_read(flag, path) if path else None for flag, path in files))
    try:
        return EnvfleetClient(args.server, token=token or None, tls=tls, insecure=args.insecure)
    except ValueError as e:  # the SDK refuses a token in clear to a remote host
        raise CommandLineError(f"{e} (here: --tls-ca CA.pem, or --insecure)") from None


@asynccontextmanager
async def orchestrator_client(args: argparse.Namespace) -> AsyncIterator[EnvfleetClient]:
    """A client of `--server`, or, only when it is absent, of an orchestrator started in this process for the
    command (its data in a temporary directory, its sandboxes destroyed on the way out)."""
    if args.server:
        async with connect(args) as client:
            yield client
        return
    from orchestrator.server.app import OrchestratorConfig, create_server

    with tempfile.TemporaryDirectory(prefix="envfleet-") as data:
        config = OrchestratorConfig(
            port=0, data_dir=Path(data), tokenizer_dirs=getattr(args, "tokenizer_dir", None) or []
        )
        orch = await create_server(config)
        try:
            async with EnvfleetClient(orch.address) as client:
                yield client
        finally:
            await orch.stop()


def rpc_error_message(e: grpc.RpcError, server: str | None) -> str:
    """One line for a failed call: who could not be reached, or what the server said."""
    code = e.code() if callable(getattr(e, "code", None)) else None
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    where = server or "the in-process orchestrator"
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach the orchestrator at {where}: {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the orchestrator at {where} did not answer in time: {details}"
    name = code.name if code is not None else "error"
    return f"{where} answered {name}: {details}"
