"""The container's health probe: asks a server's `grpc.health.v1` and exits 0 only on SERVING.

`python3 -m orchestrator.cli.healthcheck [ADDRESS]`; without an address it probes where the server in the same
container says it listens (`serving.json` in its data directory, `ENVFLEET_DATA_DIR` or serve's default), whether a
flag, a variable or the config file set the port and TLS; without that file, the port `envfleet serve` takes from
`ENVFLEET_PORT` (and `ENVFLEET_HOST`). It speaks TLS when the server does (its certificate in the file, or
`ENVFLEET_TLS_CERT`) or `--tls-ca` is given. Kept to grpc imports: docker runs it every interval.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.core.processes import owner_alive

DEFAULT_PORT = 50051  # `envfleet serve --port`
DEFAULT_DATA_DIR = ".envfleet"  # `envfleet serve --data-dir`
SERVING_FILE = "serving.json"  # server/app.py write_serving
_ANY = ("", "0.0.0.0", "::", "[::]")


def serving(environ: Mapping[str, str] = os.environ) -> dict[str, object] | None:
    """What the server of this data directory wrote of where it listens, or None (no such file, or unreadable)."""
    path = Path(environ.get("ENVFLEET_DATA_DIR") or DEFAULT_DATA_DIR) / SERVING_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(info, dict) and isinstance(info.get("host"), str) and isinstance(info.get("port"), int)
    return info if ok and _alive(info.get("pid"), info.get("started")) else None


def _alive(pid: object, started: object) -> bool:
    """Whether the process that wrote the file still runs: the same pid, started at the same tick (a container's
    server is pid 1 at every start, so a killed one's file named a live pid). Otherwise the variables count."""
    return isinstance(pid, int) and isinstance(started, str) and owner_alive(pid, started)


@dataclass(frozen=True)
class ProbeTLS:
    """How the probe reaches a TLS server: the CA to trust, a client certificate for mTLS, the name to verify."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None


def default_address(environ: Mapping[str, str] = os.environ) -> str:
    """Where the server in this container listens: as it wrote (`serving`), else from the variables that configure
    `envfleet serve`."""
    info = serving(environ)
    if info is not None:
        host, port = str(info["host"]), str(info["port"])
    else:
        host, port = environ.get("ENVFLEET_HOST", "127.0.0.1"), environ.get("ENVFLEET_PORT", str(DEFAULT_PORT))
    host = "127.0.0.1" if host in _ANY else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{port}"


def default_tls(environ: Mapping[str, str] = os.environ) -> ProbeTLS | None:
    """TLS for the server in this container: trust ENVFLEET_HEALTH_TLS_CA, else the server's own (self-signed)
    certificate; ENVFLEET_HEALTH_TLS_CERT/KEY for mTLS; ENVFLEET_HEALTH_SERVER_NAME to verify another name."""
    info = serving(environ)
    server_cert = str(info["tls_cert"]) if info is not None and info.get("tls_cert") else None
    if info is None:
        server_cert = environ.get("ENVFLEET_TLS_CERT")
    ca = environ.get("ENVFLEET_HEALTH_TLS_CA") or server_cert
    if not ca:
        return None
    cert, key = environ.get("ENVFLEET_HEALTH_TLS_CERT"), environ.get("ENVFLEET_HEALTH_TLS_KEY")
    return ProbeTLS(
        Path(ca), Path(cert) if cert else None, Path(key) if key else None, environ.get("ENVFLEET_HEALTH_SERVER_NAME")
    )


def probe(address: str, timeout_s: float = 3.0, tls: ProbeTLS | None = None) -> str:
    """The serving status name the server reports (SERVING, NOT_SERVING, ...), or UNREACHABLE: <why>."""
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        try:
            credentials = grpc.ssl_channel_credentials(
                tls.ca.read_bytes(),
                tls.key.read_bytes() if tls.key else None,
                tls.cert.read_bytes() if tls.cert else None,
            )
        except OSError as e:
            return f"UNREACHABLE: cannot read a TLS file: {e}"
        options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
        channel = grpc.secure_channel(address, credentials, options=options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            return f"UNREACHABLE: {e.code().name} {e.details()}"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    """Print the status; exit 0 when SERVING, else 1 (docker's HEALTHCHECK convention)."""
    p = argparse.ArgumentParser(prog="healthcheck", description=__doc__)
    p.add_argument(
        "address", nargs="?", default=None, help="HOST:PORT (default: the server's serving.json, or ENVFLEET_HOST/PORT)"
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--tls-ca", type=Path, help="speak TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert", type=Path, help="client certificate (PEM), for mTLS")
    p.add_argument("--tls-key", type=Path, help="client private key (PEM), for mTLS")
    p.add_argument("--server-name", help="the name the server's certificate must carry (default: the address's)")
    args = p.parse_args(argv)
    tls = ProbeTLS(args.tls_ca, args.tls_cert, args.tls_key, args.server_name) if args.tls_ca else default_tls()
    status = probe(args.address or default_address(), args.timeout, tls)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
