"""A small HTTP/1.1 client for the policy's POSTs: keep-alive connections to one server, responses parsed by httptools
(llhttp, node's parser: content-length, chunked and close-delimited bodies), read with a cap.

Why not httpx, which OpenAIPolicy used for every request before: at a worker's 64-128 requests in flight httpx and
httpcore spent ~3 ms of CPU per chat completion (the pool scans each connection's socket state per request, the
stream layers wrap every read), most of a light rollout's CPU; this client spends a tenth of that (bench/worker_cpu.py).
httpx stays for what this client does not do (proxies from the environment, a client a caller injects, hosts that
are not plain names or addresses): `supports` says which URLs this one takes.

The server is untrusted (the URL is the tenant's): its status line and headers are capped at MAX_HEAD_BYTES, its
body at the caller's `max_bytes` (declared or sent), nothing is decompressed, redirects are just answers, and
errors name what went wrong, never what the server sent.
"""

from __future__ import annotations

import asyncio
import os
import re
import ssl
import time
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httptools

MAX_HEAD_BYTES = 64 << 10  # status line and headers of one response
KEEPALIVE_EXPIRY_S = 5.0  # an idle connection older than this is closed, not reused (httpx's default)
MAX_IDLE = 512  # idle connections kept per server; more in flight at once are closed after their response
USER_AGENT = b"envfleet"
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy")
# a host this client connects to itself: a DNS name or an IPv4 / IPv6 address (anything else goes through httpx)
_PLAIN_HOST = re.compile(r"[A-Za-z0-9.-]+|[0-9A-Fa-f:.]+")
# a header value must not end the header or the request: visible ASCII, spaces and tabs only
_HEADER_VALUE = re.compile(rb"[\x20-\x7e\t]*")


class HTTPError(Exception):
    """A request that got no complete answer; the subclass says why (its name is shown in error messages)."""


class ConnectError(HTTPError):
    """No connection to the server."""


class ReadError(HTTPError):
    """The connection failed while the request was sent or its response read."""


class RemoteProtocolError(HTTPError):
    """The server broke HTTP: a malformed response, or it hung up before a complete one."""


class LocalProtocolError(HTTPError):
    """The request cannot be sent as asked (a header value that would break the request)."""


class ResponseTooLarge(HTTPError):
    """The response passed the caller's cap; `what` says how ("declares N bytes" or "sent more than N bytes")."""

    def __init__(self, status: int, what: str, headers: dict[str, str]) -> None:
        super().__init__(what)
        self.status = status
        self.what = what
        self.headers = headers


@dataclass(frozen=True)
class Response:
    """A complete response: status, headers (lower-case names; repeated ones joined by ", ") and body."""

    status: int
    headers: dict[str, str]
    content: bytes

    @property
    def is_success(self) -> bool:
        """A 2xx status."""
        return 200 <= self.status < 300


def proxied() -> bool:
    """Whether the environment names a proxy (httpx honours those; this client does not)."""
    return any(os.environ.get(v) or os.environ.get(v.upper()) for v in PROXY_VARIABLES)


def supports(url: str) -> bool:
    """Whether this client can make the request to `url` itself: http or https, a plain host, no proxy."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    host = parts.hostname or ""
    return (
        parts.scheme in ("http", "https")
        and bool(_PLAIN_HOST.fullmatch(host))
        and not parts.username
        and not parts.password
        and (port is None or 0 < port < 65536)
        and not proxied()
    )


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._done: asyncio.Future[None] | None = None
        self._max_bytes = 0
        self._reset()

    def _reset(self) -> None:
        self._status = 0
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._head_bytes_in = 0  # bytes received before the headers were complete
        self._chunks: list[bytes] = []
        self._size = 0
        self._headers_done = False
        self._complete = False
        self._until_eof = False  # the body runs to the connection's end (no length, not chunked)
        self._received = False  # any byte of the response arrived
        self._response: Response | None = None
        self._keep_alive = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():
            self._close()  # bytes nobody asked for: the connection is not in a state to reuse
            return
        self._received = True
        if not self._headers_done:
            self._head_bytes_in += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            # a callback's own error (a cap, bytes past the response) arrives as the parser error's context
            cause = e.__context__
            self._fail(cause if isinstance(cause, HTTPError) else RemoteProtocolError(f"malformed response: {e}"))
        except httptools.HttpParserUpgrade:
            self._fail(RemoteProtocolError("the server switched protocols"))
        else:
            # httptools holds a header line until it ends: one that never does is stopped here, one read past the cap
            if not self._headers_done and self._head_bytes_in > MAX_HEAD_BYTES:
                self._fail(RemoteProtocolError(f"the response's headers are over {MAX_HEAD_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is None or self._done.done():
            return
        if self._headers_done and self._until_eof and exc is None:
            self._complete = True
            self._response = Response(self._status, self._headers, b"".join(self._chunks))
            self._done.set_result(None)
        elif exc is not None:
            self._done.set_exception(ReadError(f"{type(exc).__name__}: {exc}"))
        else:
            self._done.set_exception(RemoteProtocolError("the server disconnected without a complete response"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self._complete:  # the server sent more than one response: the connection is not reused
            raise RemoteProtocolError("the server sent bytes after its response")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            raise RemoteProtocolError(f"the response's headers are over {MAX_HEAD_BYTES} bytes")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # informational (103 Early Hints): the real answer follows
            self._headers = {}
            self._head_bytes = 0
            return
        self._status = status
        self._headers_done = True
        self._keep_alive = self._parser.should_keep_alive()  # llhttp answers it until the message completes
        length = self._headers.get("content-length", "")
        chunked = "chunked" in self._headers.get("transfer-encoding", "").lower()
        self._until_eof = not length and not chunked and status not in (204, 304)
        if length.isdigit() and int(length) > self._max_bytes:
            raise ResponseTooLarge(status, f"declares {int(length)} bytes", self._headers)

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._max_bytes:
            raise ResponseTooLarge(self._status, f"sent more than {self._max_bytes} bytes", self._headers)
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        if not self._headers_done:
            return  # the end of an informational response
        self._complete = True
        self._response = Response(self._status, self._headers, b"".join(self._chunks))
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    # the client's side
    def _fail(self, error: HTTPError) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self._close()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def request(self, data: bytes, max_bytes: int) -> tuple[Response, bool]:
        """Send one request, wait for its whole response; also whether the connection may be reused."""
        assert self.transport is not None
        self._reset()
        self._max_bytes = max_bytes
        self._done = asyncio.get_running_loop().create_future()
        try:
            self.transport.write(data)
            await self._done
        except BaseException:
            self._close()  # cancelled or failed half way: the connection is in an unknown state
            raise
        finally:
            self._done = None
        assert self._response is not None
        reusable = not self.closed and not self._until_eof and self._keep_alive
        return self._response, reusable

    @property
    def fresh_failure(self) -> bool:
        """Whether the last request failed before any byte of its response came."""
        return not self._received


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to the server of one base URL; as many at once as requests in flight."""

    def __init__(self, base_url: str, ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(base_url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._tls else 80)
        self._ssl = (ssl_context or ssl.create_default_context()) if self._tls else None
        host = f"[{self._host}]" if ":" in self._host else self._host
        default_port = (443 if self._tls else 80) == self._port
        self._authority = (host if default_port else f"{host}:{self._port}").encode("idna")
        self._origin = f"{parts.scheme}://{parts.netloc}"
        self._idle: list[_Connection] = []
        self._closed = False

    def target(self, url: str) -> bytes:
        """The request target of `url` (a URL of this pool's server), percent-encoded."""
        parts = urlsplit(url)
        if f"{parts.scheme}://{parts.netloc}" != self._origin:
            raise LocalProtocolError(f"{url} is not on {self._origin}")
        path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
        if parts.query:
            path += "?" + quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
        return path.encode("ascii")

    async def post(self, url: str, body: bytes, headers: dict[str, str], max_bytes: int) -> Response:
        """POST `body` as JSON to `url` and return the complete response; HTTPError (a subclass) when none came."""
        head = [b"POST ", self.target(url), b" HTTP/1.1\r\nHost: ", self._authority]
        head.append(b"\r\nUser-Agent: " + USER_AGENT + b"\r\nAccept: */*\r\nContent-Type: application/json")
        for name, value in headers.items():
            raw = value.encode("ascii", errors="replace")
            if not _HEADER_VALUE.fullmatch(raw) or not name.isascii() or not name.replace("-", "").isalnum():
                raise LocalProtocolError(f"the {name} header has characters a header cannot carry")
            head.append(b"\r\n" + name.encode() + b": " + raw)
        head.append(b"\r\nContent-Length: %d\r\n\r\n" % len(body))
        data = b"".join(head) + body
        conn, reused = await self._acquire()
        try:
            response, reusable = await conn.request(data, max_bytes)
        except (ReadError, RemoteProtocolError):
            if not (reused and conn.fresh_failure):
                raise
            # a kept-alive connection the server closed as this request went out: once more, on a new one
            conn, _ = await self._acquire(fresh=True)
            response, reusable = await conn.request(data, max_bytes)
        if reusable and not self._closed and len(self._idle) < MAX_IDLE:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn._close()
        return response

    async def _acquire(self, fresh: bool = False) -> tuple[_Connection, bool]:
        if self._closed:
            raise ConnectError("the connection pool is closed")
        now = time.monotonic()
        while self._idle and not fresh:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_EXPIRY_S:
                return conn, True
            conn._close()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                _Connection, self._host, self._port, ssl=self._ssl, server_hostname=self._host if self._tls else None
            )
        except (OSError, ssl.SSLError) as e:  # refused, unreachable, no such host, a certificate refused
            raise ConnectError(f"{type(e).__name__}: {e}") from e
        return conn, False

    async def aclose(self) -> None:
        """Close every idle connection; those in flight close when their response is read."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn._close()
