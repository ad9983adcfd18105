"""Address checks shared by the client and the server."""

from __future__ import annotations

import ipaddress

import grpc

from orchestrator.core.errors import ConfigError


def is_loopback(host: str) -> bool:
    """Whether a listen address only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# gRPC servers bind with SO_REUSEPORT unless told not to: a second server on a port in use started without a word,
# and the kernel spread new connections over both (a trainer's calls went to either control plane)
NO_SHARED_PORT = ("grpc.so_reuseport", 0)


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets (`::1:50051` is no address gRPC can listen on)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def listen(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None, flag: str) -> int:
    """Add a listening port to `server`; ConfigError naming `flag` when it cannot bind (gRPC raised a bare
    RuntimeError, a traceback from `envfleet serve`)."""
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:
        raise ConfigError(
            f"cannot listen on {address} ({flag}): the port is taken, or the host is not one of this machine's "
            f"addresses ({e})"
        ) from None
    return int(port)
