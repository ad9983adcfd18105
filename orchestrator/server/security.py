"""Who may call: bearer tokens (tenants), TLS / mTLS, and the rule that secrets never cross a network in clear.

- With a token file, every call but health must carry `authorization: Bearer <token>`; the token names the tenant.
- Without one, every caller is the single local tenant; that is only allowed on a loopback address.
- A plaintext port on a non-loopback address is refused at start unless the operator passes `insecure`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict

from orchestrator.core.errors import ConfigError, UnauthenticatedError
from orchestrator.core.net import is_loopback
from orchestrator.service.tenancy import LOCAL_TENANT, TokenSource

log = logging.getLogger(__name__)

# Calls that need no token: a load balancer or orchestrator supervisor must be able to probe health.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
MAX_TOKEN_CHARS = 4096


class TLSConfig(BaseModel):
    """Certificate files of the server; with `client_ca_file`, clients must present a certificate it signed (mTLS)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None


class SecurityConfig(BaseModel):
    """Authentication and transport security of an orchestrator."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_file: Path | None = None
    tls: TLSConfig | None = None
    insecure: bool = False  # allow plaintext on a non-loopback address (logged loudly)


def check_transport(host: str, security: SecurityConfig) -> None:
    """Refuse a plaintext server on a non-loopback address unless the operator insisted (then log loudly)."""
    if security.tls is not None or is_loopback(host):
        return
    what = "bearer tokens would cross the network in clear" if security.token_file else "anyone could call it"
    if not security.insecure:
        raise ConfigError(
            f"refusing to serve plaintext on {host!r}: {what}. Give TLS certificates (--tls-cert/--tls-key), "
            "listen on 127.0.0.1, or pass --insecure if you really mean it"
        )
    log.warning("!" * 78)
    log.warning("INSECURE: serving plaintext gRPC on %s (%s); use TLS outside a trusted network", host, what)
    log.warning("!" * 78)


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """TLS credentials from the configured files; ConfigError names a file that cannot be read."""

    def read(path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror}") from None

    ca = read(tls.client_ca_file) if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(read(tls.key_file), read(tls.cert_file))], root_certificates=ca, require_client_auth=ca is not None
    )


class Authenticator:
    """Maps a call's metadata to its tenant."""

    def __init__(self, tokens: TokenSource | None = None) -> None:
        self._tokens = tokens

    @classmethod
    def from_config(cls, security: SecurityConfig) -> Authenticator:
        """Token auth when a token file is configured, else the single local tenant."""
        return cls(TokenSource(security.token_file) if security.token_file else None)

    @property
    def enabled(self) -> bool:
        """Whether calls need a token."""
        return self._tokens is not None

    def tenant_of_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """The tenant of a call with this metadata; UnauthenticatedError when the token is missing or bad."""
        if self._tokens is None:
            return LOCAL_TENANT
        values = [v for k, v in metadata if k == "authorization"]
        if not values:
            raise UnauthenticatedError("missing bearer token: send metadata 'authorization: Bearer <token>'")
        value = values[0] if isinstance(values[0], str) else values[0].decode("utf-8", "replace")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise UnauthenticatedError("malformed authorization metadata: expected 'Bearer <token>'")
        if len(token) > MAX_TOKEN_CHARS:
            raise UnauthenticatedError("invalid bearer token")
        return self._tokens.table().tenant_of(token.strip())

    def tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The calling tenant (servicers call this; the interceptor has already refused bad tokens)."""
        return self.tenant_of_metadata(context.invocation_metadata() or ())


def _denying(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    code = grpc.StatusCode.UNAUTHENTICATED
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # pragma: no cover - abort raises

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(stream, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call without a valid token (health excepted) before any servicer code runs."""

    def __init__(self, auth: Authenticator) -> None:
        self._auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self._auth.enabled or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        try:
            self._auth.tenant_of_metadata(details.invocation_metadata or ())
        except UnauthenticatedError as e:
            return _denying(handler, str(e))
        return handler
