"""One interceptor maps every envfleet error to a gRPC status with the error's message; nothing leaks as UNKNOWN.

Messages are bounded (a status past 16 KiB of headers breaks the HTTP/2 stream). An INTERNAL error's text stays in
the log: the caller gets an error id, which is in the log line too, never the exception's text (paths, internals).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import inspect
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status
from pydantic import ValidationError

from orchestrator.core.echo import bounded
from orchestrator.core.errors import (
    SERVER_STATUS_KEY,
    AlreadyExistsError,
    BusyError,
    ConfigError,
    EnvfleetError,
    FailedPreconditionError,
    InvalidRequestError,
    LimitNotAppliedError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    SandboxError,
    SandboxFileError,
    SandboxFileNotFoundError,
    SandboxPermissionError,
    UnauthenticatedError,
)
from orchestrator.server.map_guard import map_counter
from protos import orchestrator_pb2

log = logging.getLogger(__name__)

# by base class, most specific first (orchestrator/core/errors.py: every leaf derives from one of these)
STATUS_OF: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    # file errors inside a sandbox are the caller's (a raw sandbox's owner): what envd said, not an outage
    (SandboxFileNotFoundError, grpc.StatusCode.NOT_FOUND),
    (SandboxPermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (SandboxFileError, grpc.StatusCode.FAILED_PRECONDITION),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (QuotaExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # a limit or runtime this engine cannot apply: retrying will not help until the host is set up for it
    (LimitNotAppliedError, grpc.StatusCode.FAILED_PRECONDITION),
    (SandboxError, grpc.StatusCode.UNAVAILABLE),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (EnvfleetError, grpc.StatusCode.INTERNAL),
]


def status_for(e: BaseException) -> grpc.StatusCode | None:
    """The status code of a known error, or None for a bug."""
    return next((code for cls, code in STATUS_OF if isinstance(e, cls)), None)


async def _abort(context: grpc.aio.ServicerContext, e: Exception, method: str) -> None:
    code = status_for(e)
    # this server's answer, not the transport's (the OpenEnv facade reads it)
    ours: tuple[tuple[str, str | bytes], ...] = ((SERVER_STATUS_KEY, "1"),)
    if code is None or code == grpc.StatusCode.INTERNAL:
        error_id = secrets.token_hex(6)
        log.error("internal error in %s (error id %s)", method, error_id, exc_info=e)
        await context.abort(
            grpc.StatusCode.INTERNAL,
            f"internal error in {method} (error id {error_id}; the server log has details)",
            trailing_metadata=ours,
        )
    message = bounded(str(e))
    if isinstance(e, BusyError):
        ours += retry_info(message, e.retry_after_s)
    await context.abort(code, message, trailing_metadata=ours)


def retry_info(message: str, after_s: float) -> tuple[tuple[str, str | bytes], ...]:
    """The trailer of a RESOURCE_EXHAUSTED that may succeed after `after_s`: a google.rpc.Status (the same code and
    message, as gRPC's rich error model requires) whose detail is a RetryInfo."""
    detail = error_details_pb2.RetryInfo()
    detail.retry_delay.FromNanoseconds(round(after_s * 1e9))
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message)
    status.details.add().Pack(detail)
    return tuple(rpc_status.to_status(status).trailing_metadata)


class WrappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """An interceptor that wraps each method's handler once, not per call (the servicers' handlers are the same
    objects call after call); `_wrap` says how."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None  # an unknown method: nothing is kept for it
        cached = self._wrapped.get(details.method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[details.method] = (handler, self._wrap(handler, details.method))
        return cached[1]

    @abc.abstractmethod
    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """The handler that calls of `method` get in place of `handler`."""


class ErrorInterceptor(WrappingInterceptor):
    """Wraps every handler so that an exception becomes a status with a message a user can act on."""

    def __init__(self, request_bytes: dict[str, int] | None = None) -> None:
        super().__init__()
        # method -> the largest request it takes, under the server's message size: one refused past it is dropped as
        # it is read, not held for as long as its handler waits (a Step waits behind its session's running step)
        self._request_bytes = dict(request_bytes or {})

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return _wrap(handler, method, self._request_bytes.get(method))


class UnreadableRequestError(InvalidRequestError):
    """A request message that does not parse: gRPC parses it before any handler runs, and its error was UNKNOWN."""


# the public API's requests whose maps are counted before they are parsed (map_guard: a map's parse is not linear)
_MAPS = map_counter([m.input_type for s in orchestrator_pb2.DESCRIPTOR.services_by_name.values() for m in s.methods])


def _lenient(deserialize: Callable[[bytes], Any] | None, max_bytes: int | None = None) -> Callable[[bytes], Any] | None:
    """`deserialize`, with a message that does not parse (a string field that is not UTF-8: how a lone surrogate
    arrives), over `max_bytes`, or with maps over map_guard's limits, read as the UnreadableRequestError the
    handler's wrapper raises."""
    if deserialize is None:
        return None
    request_type = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)

    def read(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return UnreadableRequestError(f"the request message is {len(data)} bytes, over this call's {max_bytes}")
        if request_type is not None and (over := _MAPS(request_type, data)) is not None:
            return UnreadableRequestError(f"the request message was refused unparsed: {over}")
        try:
            return deserialize(data)
        except DecodeError as e:
            return UnreadableRequestError(f"the request message does not parse: {e} (string fields must be UTF-8)")

    return read


async def _readable(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, UnreadableRequestError):
            raise request
        yield request


def _wrap(handler: grpc.RpcMethodHandler, method: str, max_bytes: int | None = None) -> grpc.RpcMethodHandler:
    """`handler` with its exceptions turned into statuses, a request that does not parse, or is over `max_bytes`, as
    INVALID_ARGUMENT."""
    deserialize = _lenient(handler.request_deserializer, max_bytes)
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        @functools.wraps(inner_uu)
        async def uu(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if isinstance(request, UnreadableRequestError):
                    raise request
                return await inner_uu(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _abort(context, e, method)

        return grpc.unary_unary_rpc_method_handler(
            uu, request_deserializer=deserialize, response_serializer=handler.response_serializer
        )
    if handler.unary_stream or handler.stream_stream:
        inner_us = handler.unary_stream or handler.stream_stream
        streamed = handler.stream_stream is not None
        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        if not inspect.isasyncgenfunction(inner_us):
            # a streaming handler may write its messages itself (context.write) and return: health's Watch does,
            # and iterated as a generator it answered INTERNAL
            @functools.wraps(inner_us)
            async def written(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    if isinstance(request, UnreadableRequestError):
                        raise request
                    return await inner_us(_readable(request) if streamed else request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await _abort(context, e, method)

            return make(written, request_deserializer=deserialize, response_serializer=handler.response_serializer)

        async def us(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                if isinstance(request, UnreadableRequestError):
                    raise request
                # closed here when this is closed (Auth's watch closes it): what the handler holds goes back then,
                # not when the collector finds it
                async with contextlib.aclosing(inner_us(_readable(request) if streamed else request, context)) as it:
                    async for item in it:
                        yield item
            except grpc.aio.AbortError:
                raise
            except Exception as e:
                await _abort(context, e, method)

        return make(us, request_deserializer=deserialize, response_serializer=handler.response_serializer)
    return handler
