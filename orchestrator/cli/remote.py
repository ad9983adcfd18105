"""The command line's security and client parts: `serve`'s TLS/token flags, the flags a client command uses to reach
a server, and `envfleet envs register spec.yaml`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import grpc
from rich.console import Console

from orchestrator.client.auth import ClientTLS
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.server.security import SecurityConfig, TLSConfig


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
    p.add_argument("--session-ttl", type=float, default=600.0, help="seconds an idle session lives")
    p.add_argument(
        "--allow-policy-url",
        action="append",
        metavar="PREFIX",
        help="a URL prefix jobs' policies may be served under (repeatable; host may start with '*.'); default: any",
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
        )
    except ValueError as e:
        raise SystemExit(f"envfleet serve: {e}") from None


def add_client_arguments(
    p: argparse.ArgumentParser, server_default: str | None = "127.0.0.1:50051", server_help: str = ""
) -> None:
    """How a client command reaches a server."""
    p.add_argument("--server", default=server_default, help=server_help or "orchestrator address")
    p.add_argument("--token-file", help="a file holding your bearer token (default: $ENVFLEET_TOKEN)")
    p.add_argument("--tls-ca", help="CA certificate to trust (PEM); turns TLS on")
    p.add_argument("--tls-cert", help="client certificate (PEM), for mTLS")
    p.add_argument("--tls-key", help="client private key (PEM), for mTLS")
    p.add_argument("--insecure", action="store_true", help="allow sending the token in clear to a remote server")


def connect(args: argparse.Namespace) -> EnvfleetClient:
    """An EnvfleetClient for the client flags (the token from --token-file, else $ENVFLEET_TOKEN)."""
    token = Path(args.token_file).read_text().strip() if args.token_file else os.environ.get("ENVFLEET_TOKEN")
    tls = None
    if args.tls_ca or args.tls_cert:
        tls = ClientTLS.from_files(*(Path(p) if p else None for p in (args.tls_ca, args.tls_cert, args.tls_key)))
    return EnvfleetClient(args.server, token=token or None, tls=tls, insecure=args.insecure)


def add_register_command(envs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`envfleet envs register spec.yaml`."""
    register = envs.add_parser("register", help="register a declarative environment (spec YAML) with a server")
    register.add_argument("spec", help="the spec: YAML or JSON (tasks_file and image.dockerfile_file are relative)")
    register.add_argument("--dry-run", action="store_true", help="only validate: build, load, run the reference")
    register.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the server")
    add_client_arguments(register)
    register.set_defaults(fn=cmd_register)


def cmd_register(args: argparse.Namespace) -> int:
    """Validate the spec locally, then Register (or Validate) it on the server; problems are printed one a line."""
    from orchestrator.server.convert_specs import spec_to_pb
    from orchestrator.service.declarative import SpecError, load_spec_file

    out, err = Console(), Console(stderr=True)
    try:
        spec = load_spec_file(Path(args.spec))
    except SpecError as e:
        err.print(f"[red]{args.spec}: {len(e.problems)} problem(s)[/red]")
        for problem in e.problems:
            err.print(f"  {problem.field}: {problem.message}", markup=False, highlight=False)
        return 2

    async def go() -> int:
        async with connect(args) as client:
            try:
                if args.dry_run:
                    report = await client.env_stub.Validate(spec_to_pb(spec), timeout=args.timeout)
                    out.print(f"{report.env} is valid ({report.duration_s:.1f}s)")
                    for check in report.checks:
                        out.print(f"  {check}", markup=False, highlight=False)
                    return 0
                info = await client.env_stub.Register(spec_to_pb(spec), timeout=args.timeout)
            except grpc.aio.AioRpcError as e:
                err.print(f"{e.code().name}: {e.details()}", markup=False, highlight=False)
                return 1
        out.print(f"registered {info.name}@{info.version}: {info.num_tasks} task(s), image {info.image}")
        return 0

    try:
        return asyncio.run(go())
    except ValueError as e:  # e.g. a token that would go out in clear
        print(f"error: {e}", file=sys.stderr)
        return 2
