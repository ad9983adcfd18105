"""The policy's HTTP client: one aiohttp session per policy, keep-alive connections, responses read with a cap.

Why aiohttp, not httpx, which OpenAIPolicy used for every request before: at a worker's 64-128 requests in flight
httpx and httpcore spent ~3 ms of CPU per chat completion (the pool scans each connection's socket state per request,
the stream layers wrap every read), most of a light rollout's CPU. aiohttp parses with llhttp in C and its pool is
a dict of idle connections. It replaced a hand-written httptools client that was cheaper still: worker CPU per light
rollout (3 requests) 3.4-3.7 ms with that client, 5.8-5.9 ms with this one (bench/worker_cpu.py, 320 rollouts at 64,
interleaved): ~0.75 ms a request more, kept for a well-kept library over ~300 lines of our own HTTP.

The server is untrusted (the URL is the tenant's): its status line and headers are held to aiohttp's limits (8190
bytes a line, 128 headers), its body to the caller's `max_bytes` (declared or sent), nothing is decompressed (and no
compression is asked for), redirects are just answers, the environment gives proxies only (no netrc credentials),
and errors name what went wrong, never what the server sent.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import math
import os
import re
import ssl
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import aiohttp
import certifi

from orchestrator.core.errors import PolicyError

T = TypeVar("T")

KEEPALIVE_EXPIRY_S = 5.0  # an idle connection older than this is closed, not reused (httpx's default)
# as many connections as httpx allowed (128 pools of 64); the scheduler, not the pool, bounds what is in flight
MAX_CONNECTIONS = 128 * 64
USER_AGENT = "envfleet"
READ_CHUNK = 1 << 16
# a header value must not end the header or the request: visible ASCII, spaces and tabs only
_HEADER_VALUE = re.compile(r"[\x20-\x7e\t]*")
_HEADER_NAME = re.compile(r"[A-Za-z0-9-]+")


class HTTPError(PolicyError):
    """A request that got no complete answer; the subclass says why (its name is shown in error messages). Raised
    inside the policy client only: it becomes a PolicyError (or a retry) there. `down`: no connection could be made
    to the server (refused, reset, its host unreachable), as while it restarts. A server that hung up on a request
    it had taken is not: that may be the request's doing (a proxy's limit on a long generation), and the retry after
    a crash finds the port closed."""

    def __init__(self, message: str, *, down: bool = False) -> None:
        super().__init__(message)
        self.down = down


class ConnectError(HTTPError):
    """No connection to the server (or to the proxy)."""


class ReadError(HTTPError):
    """The connection failed while the request was sent or its response read."""


class RemoteProtocolError(HTTPError):
    """The server broke HTTP: a malformed response, or it hung up before a complete one."""


class LocalProtocolError(HTTPError):
    """The request cannot be sent as asked (a header value that would break the request)."""


@dataclass
class Progress:
    """When a 2xx event stream answering a request last sent bytes (the loop's time), for whoever set PROGRESS around
    the request: a stream that keeps sending is a generation going on, one that is silent may be a hung server. The
    client forgets it when it retries (the stream it saw was not the answer), and counts the seconds its failed
    attempts and their pauses took in `lost` (the server's time, not the policy's)."""

    last: float = -math.inf
    lost: float = 0.0
    waits: Waits | None = None  # the rollout's allowance to wait out its server down or busy


class Waits:
    """A rollout attempt's allowance to wait out its policy server down or busy past each request's retries
    (PolicyEndpoint.outage_wait_s, for all its requests), and what it waited: none of it is the policy's time, so
    each limit of the attempt moves on by `waited` (`moved` is told each pause before it is taken, and moves the
    attempt's own end)."""

    def __init__(self, allowed_s: float, moved: Callable[[float], None] | None = None) -> None:
        self.left = allowed_s
        self.waited = 0.0
        self._moved = moved

    def take(self, seconds: float) -> bool:
        """Spend `seconds` of the allowance on one more pause (the failed attempt's time and the pause); False when
        too little is left."""
        if seconds > self.left:
            return False
        self.left -= seconds
        self.waited += seconds
        if self._moved is not None:
            self._moved(seconds)
        return True


PROGRESS: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("envfleet_policy_progress", default=None)


class ResponseTooLarge(HTTPError):
    """The response passed the caller's cap; `what` says how ("declares N bytes" or "sent more than N bytes"), and
    `partial` holds what was read before it was cut (the cap's worth, or nothing for a declared size)."""

    def __init__(self, status: int, what: str, headers: Mapping[str, str], partial: bytes = b"") -> None:
        super().__init__(what)
        self.status = status
        self.what = what
        self.headers = headers
        self.partial = partial


@dataclass(frozen=True)
class Response:
    """A complete response: status, headers (looked up case-insensitively) and body."""

    status: int
    headers: Mapping[str, str]
    content: bytes

    @property
    def is_success(self) -> bool:
        """A 2xx status."""
        return 200 <= self.status < 300


_DOWN_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH})


def _down(error: OSError) -> bool:
    """Whether a failed connect says the server is not there now (it may be restarting), not that it is named wrong
    (no such host) or refused (a certificate)."""
    return error.errno in _DOWN_ERRNOS


def _malformed(e: BaseException) -> str:
    """What was wrong with a response aiohttp could not parse, by the parser error's kind: aiohttp's own message
    quotes the server's bytes, which an error here never does."""
    kinds: list[str] = []
    cause: BaseException | None = e
    while cause is not None and len(kinds) < 8:
        kinds.append(type(cause).__name__)
        cause = cause.__cause__
    if "LineTooLong" in kinds:
        return "the response's headers are over aiohttp's limits (8190 bytes a line, 128 headers)"
    kind = next((k for k in reversed(kinds) if k not in ("ClientResponseError", "HttpProcessingError")), "")
    return f"malformed response ({kind or 'unparsable'})"


def ssl_context() -> ssl.SSLContext:
    """The certificates httpx verified with: SSL_CERT_FILE or SSL_CERT_DIR when set, else certifi's (not the
    system's store, which aiohttp's default would use); ~60 ms to build, so one per policy."""
    if os.environ.get("SSL_CERT_FILE"):
        return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    if os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
    return ssl.create_default_context(cafile=certifi.where())


def proxy_for(url: str) -> str | None:
    """The proxy the environment names for `url` (HTTP(S)_PROXY, ALL_PROXY, NO_PROXY), as httpx read it; None when
    it names none or NO_PROXY exempts the host. Read here, not by aiohttp's `trust_env`, which would also send
    credentials from ~/.netrc to a tenant's server."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


class Client:
    """POSTs to one policy server through one aiohttp session; the session is made on the first request, in the
    event loop that uses it."""

    def __init__(self, base_url: str, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context if ssl_context is not None else True
        self._proxy = proxy_for(base_url)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise ConnectError("the client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=MAX_CONNECTIONS, limit_per_host=0, keepalive_timeout=KEEPALIVE_EXPIRY_S, ssl=self._ssl
                ),
                # the attempt's own asyncio.timeout bounds connect, send and read together (the caller's)
                timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None, sock_read=None),
                headers={"User-Agent": USER_AGENT},
                skip_auto_headers=("Accept-Encoding",),  # nothing is decompressed, so nothing compressed is asked for
                auto_decompress=False,
                trust_env=False,
                raise_for_status=False,
            )
        return self._session

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], max_bytes: int, idle_timeout_s: float | None = None
    ) -> Response:
        """POST `body` as JSON to `url` and return the complete response; HTTPError (a subclass) when none came.
        With `idle_timeout_s`, TimeoutError when the server sends nothing for that long (its headers, or the next
        piece of the body): a streamed answer may take as long as it keeps coming. Without, the caller bounds the
        whole request."""
        for name, value in headers.items():
            if not _HEADER_NAME.fullmatch(name) or not _HEADER_VALUE.fullmatch(value):
                raise LocalProtocolError(f"the {name} header has characters a header cannot carry")
        session = self._open()
        sent = {**headers, "Content-Type": "application/json"}
        try:
            try:
                return await self._post(session, url, body, sent, max_bytes, idle_timeout_s)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                if isinstance(e, aiohttp.ClientConnectorError):
                    raise
                # no answer at all: most often a kept-alive connection the server closed as this request went out
                # (aiohttp resends only idempotent methods so, not a POST); once more, before the caller's backoff
                return await self._post(session, url, body, sent, max_bytes, idle_timeout_s)
        except aiohttp.ClientConnectorError as e:  # refused, unreachable, no such host, a certificate refused
            raise ConnectError(f"{type(e).__name__}: {e.os_error}", down=_down(e.os_error)) from e
        except aiohttp.ServerDisconnectedError as e:
            raise RemoteProtocolError("the server disconnected without a complete response") from e
        except aiohttp.ClientPayloadError as e:
            raise RemoteProtocolError(f"the server disconnected without a complete response ({e})") from e
        except aiohttp.ClientResponseError as e:  # the response could not be parsed
            raise RemoteProtocolError(_malformed(e)) from e
        except aiohttp.ClientOSError as e:
            raise ReadError(f"{type(e).__name__}: {e}") from e
        except aiohttp.ClientConnectionError as e:
            raise ReadError(f"{type(e).__name__}: {e}") from e
        except (aiohttp.ClientError, ValueError) as e:  # ValueError: a URL or proxy aiohttp refuses
            raise LocalProtocolError(f"{type(e).__name__}: {e}") from e

    async def _post(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: bytes,
        headers: dict[str, str],
        max_bytes: int,
        idle_timeout_s: float | None,
    ) -> Response:
        request = session.post(url, data=body, headers=headers, allow_redirects=False, proxy=self._proxy)
        async with await _within(idle_timeout_s, request) as resp:
            declared = resp.content_length
            if declared is not None and declared > max_bytes:
                resp.close()  # the connection is not drained for reuse
                raise ResponseTooLarge(resp.status, f"declares {declared} bytes", resp.headers)
            chunks: list[bytes] = []
            size = 0
            progress, loop = PROGRESS.get(), asyncio.get_running_loop()
            if not (200 <= resp.status < 300 and resp.content_type == "text/event-stream"):
                progress = None  # an error's body, or a whole answer: no generation seen going on
            while chunk := await _within(idle_timeout_s, resp.content.read(READ_CHUNK)):
                if progress is not None:
                    progress.last = loop.time()
                size += len(chunk)
                if size > max_bytes:
                    resp.close()
                    chunks.append(chunk[: len(chunk) - (size - max_bytes)])
                    partial = b"".join(chunks)
                    chunks.clear()
                    try:
                        raise ResponseTooLarge(resp.status, f"sent more than {max_bytes} bytes", resp.headers, partial)
                    finally:
                        del partial, chunk  # the error's traceback keeps this frame: the bytes go with the caller's
                chunks.append(chunk)
            return Response(resp.status, resp.headers, b"".join(chunks))

    async def aclose(self) -> None:
        """Close the session and its connections."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()


async def _within(timeout_s: float | None, step: Awaitable[T]) -> T:
    """`step`, within `timeout_s` when there is one (TimeoutError past it)."""
    if timeout_s is None:
        return await step
    async with asyncio.timeout(timeout_s):
        return await step
