"""Client-side credentials: a bearer token on every call, TLS (with an optional client certificate for mTLS).

A token is never sent in clear to a non-loopback address unless the caller passes `insecure=True`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from orchestrator.core.net import is_loopback

MAX_MESSAGE_BYTES = 64 << 20
# the client pings a quiet connection: a server whose host went away without a word (a crash, a partition) is found
# out in about a minute, and a stream reconnects or fails, where it waited on a dead connection for hours. The
# server allows pings this often (orchestrator/server/app.py)
KEEPALIVE_MS = 30_000
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.ping_timeout_ms", 20_000),  # what newer gRPC cores wait for a ping's answer (keepalive's included)
    ("grpc.keepalive_permit_without_calls", 1),
    # a stream quiet for long (slow rollouts) is pinged all along, not twice and then after five minutes
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_MS),
]


@dataclass(frozen=True)
class ClientTLS:
    """What a client trusts (root_certificates; None: the system's roots) and, for mTLS, what it presents."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None

    @classmethod
    def from_files(cls, ca: Path | None = None, cert: Path | None = None, key: Path | None = None) -> ClientTLS:
        """Read PEM files (any may be None)."""
        return cls(*(p.read_bytes() if p else None for p in (ca, cert, key)))

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials."""
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def target_host(target: str) -> str:
    """The host part of `host:port`, `[v6]:port` or `dns:///host:port`."""
    rest = target.split("///", 1)[-1]
    host = rest.rpartition(":")[0] if ":" in rest else rest
    return host.strip("[]")


def check_client_transport(target: str, token: str | None, tls: ClientTLS | None, insecure: bool) -> None:
    """Refuse to send a token in clear over the network (a unix socket never leaves the host)."""
    if target.startswith("unix:"):
        return
    if token and tls is None and not insecure and not is_loopback(target_host(target)):
        raise ValueError(
            f"refusing to send a bearer token in clear to {target}: use TLS, or pass insecure=True if you mean it"
        )


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying a token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *bearer_metadata(token))
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _Bearer:
    """Adds the bearer token to the calls of an aio channel. grpc.aio files an interceptor under the first call
    kind it implements, so each kind is an object of its own (the subclasses below)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def _carry(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(_with_token(details, self._token), request)


class _BearerUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._carry(continuation, client_call_details, request)


class _BearerStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._carry(continuation, client_call_details, request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, requests: Any) -> Any:
        return await self._carry(continuation, client_call_details, requests)


class _BearerStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, requests: Any) -> Any:
        return await self._carry(continuation, client_call_details, requests)


def aio_channel(
    target: str, *, token: str | None = None, tls: ClientTLS | None = None, insecure: bool = False
) -> grpc.aio.Channel:
    """An asyncio channel that carries the token on every call, of every kind (TLS when given): with unary and
    server-streaming ones alone, an ExecStream went out without it, UNAUTHENTICATED."""
    check_client_transport(target, token, tls, insecure)
    interceptors = (
        [_BearerUnary(token), _BearerStream(token), _BearerStreamUnary(token), _BearerStreamStream(token)]
        if token
        else None
    )
    if tls is not None:
        return grpc.aio.secure_channel(target, tls.credentials(), options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=interceptors)


def sync_channel(
    target: str, *, token: str | None = None, tls: ClientTLS | None = None, insecure: bool = False
) -> grpc.Channel:
    """A blocking channel (pass `bearer_metadata(token)` as each call's metadata)."""
    check_client_transport(target, token, tls, insecure)
    if tls is not None:
        return grpc.secure_channel(target, tls.credentials(), options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
