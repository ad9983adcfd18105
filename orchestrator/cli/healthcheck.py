"""The container's health probe: asks a server's `grpc.health.v1` and exits 0 only on SERVING.

`python3 -m orchestrator.cli.healthcheck [ADDRESS]`; without an address it probes the port `envfleet serve` takes
from `ENVFLEET_PORT` (and `ENVFLEET_HOST`) in the same container. Kept to grpc imports: docker runs it every interval.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_PORT = 50051  # `envfleet serve --port`
_ANY = ("", "0.0.0.0", "::", "[::]")


def default_address(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Where the server in this container listens, from the variables that configure `envfleet serve`."""
    host = environ.get("ENVFLEET_HOST", "127.0.0.1")
    host = "127.0.0.1" if host in _ANY else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{environ.get('ENVFLEET_PORT', str(DEFAULT_PORT))}"


def probe(address: str, timeout_s: float = 3.0) -> str:
    """The serving status name the server reports (SERVING, NOT_SERVING, ...), or UNREACHABLE: <why>."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            return f"UNREACHABLE: {e.code().name} {e.details()}"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    """Print the status; exit 0 when SERVING, else 1 (docker's HEALTHCHECK convention)."""
    p = argparse.ArgumentParser(prog="healthcheck", description=__doc__)
    p.add_argument("address", nargs="?", default=None, help="HOST:PORT (default: from ENVFLEET_HOST/ENVFLEET_PORT)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = p.parse_args(argv)
    status = probe(args.address or default_address(), args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
