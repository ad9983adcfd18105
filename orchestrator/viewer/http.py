"""The viewer's HTTP server: stdlib `ThreadingHTTPServer` on its own threads, GET only (plus the login form), each
request authenticated like the API and answered from a Source.

Authentication: with tokens, a request carries `Authorization: Bearer <token>` or the HttpOnly cookie that the
/login form sets; the token names the tenant, who sees only its own jobs. Without tokens the viewer serves loopback
only, and a request whose Host header is not a loopback name is refused (a DNS-rebinding page cannot read it).
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from orchestrator.core.errors import NotFoundError, UnauthenticatedError
from orchestrator.core.models import Rollout
from orchestrator.service.jobs import JobManager
from orchestrator.viewer.html import CSP, esc, page
from orchestrator.viewer.index import Query
from orchestrator.viewer.pages import group_page, job_page, jobs_page
from orchestrator.viewer.rollout_page import TokenDecoder, rollout_page
from orchestrator.viewer.sources import LiveSource, Source

log = logging.getLogger(__name__)

COOKIE = "envfleet_ui_token"
MAX_FORM_BYTES = 8192
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1", "[::1]"}

# The Authorization header's value (None when absent) -> the tenant whose jobs the caller sees (None: every job);
# raises UnauthenticatedError.
TenantOf = Callable[[str | None], str | None]
DecoderFor = Callable[[Rollout], TokenDecoder | None]


def _no_decoder(rollout: Rollout) -> TokenDecoder | None:
    return None


# a cookie's value (RFC 6265 cookie-octet): visible ASCII but for space, ", comma, ; and backslash
_COOKIE_VALUE = re.compile(r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]{1,4096}")


MAX_RENDERS = 4  # pages rendered at once; more wait their turn
# connections served at once, each a thread of the control plane's process, before any token is checked: more wait
# in the listen queue until one ends (10,000 idle sockets were 10,000 threads)
MAX_CONNECTIONS = 64
HEAD_DEADLINE_S = 10.0  # for a request's line and headers to arrive, from when the connection waits for them
RENDER_WAIT_S = 30.0  # then the page answers 503 Busy


class ViewerServer:
    """The viewer serving a source on host:port (port 0: a free one) until `close()`."""

    def __init__(
        self,
        source: Source,
        host: str = "127.0.0.1",
        port: int = 0,
        tenant_of: TenantOf | None = None,
        auth_enabled: bool = False,
        decoder_for: DecoderFor = _no_decoder,
    ) -> None:
        self.source = source
        self.tenant_of: TenantOf = tenant_of or (lambda header: None)
        self.auth_enabled = auth_enabled
        self.decoder_for = decoder_for
        # pages rendered at once: a page of a rollout a hostile policy filled holds its rollouts decoded (hundreds of
        # MiB), and each request had a thread of its own, so a few tabs at once took the control plane's memory
        self.renders = threading.BoundedSemaphore(MAX_RENDERS)
        viewer = self

        class Handler(_Handler):
            server_viewer = viewer

        self._http = _BoundedServer((host, port), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, name="envfleet-viewer", daemon=True)

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._http.server_address[1])

    @property
    def url(self) -> str:
        """Its base URL."""
        host = str(self._http.server_address[0])
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def __enter__(self) -> ViewerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> ViewerServer:
        """Serve on a background thread."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and free the port."""
        self._http.closing.set()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(10)
        self.source.close()

    def render(self, path: str, params: dict[str, str], tenant: str | None) -> str:
        """The page at `path` for a tenant; NotFoundError for a path or id that is not there."""
        parts = [unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
        src = self.source
        match parts:
            case []:
                return jobs_page(src.jobs(tenant))
            case ["job", job_id]:
                return job_page(src.job(tenant, job_id), src.index(tenant, job_id), Query.from_params(params))
            case ["job", job_id, "rollout", rollout_id]:
                shown = src.rollout(tenant, job_id, rollout_id)
                return rollout_page(shown.rollout, self.decoder_for(shown.rollout), slim=shown.slim)
            case ["job", job_id, "group", group_id]:
                samples = src.group(tenant, job_id, group_id)
                if not samples:
                    raise NotFoundError(f"no group {group_id!r} in job {job_id!r}")
                return group_page(src.job(tenant, job_id), group_id, samples)
        raise NotFoundError(f"no page {path!r}")


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.closing = threading.Event()

    def process_request(self, request: Any, client_address: Any) -> None:
        # the accepting thread waits: the next connections queue in the kernel meanwhile
        while not self._slots.acquire(timeout=0.5):
            if self.closing.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _HeadDeadline(socket.SocketIO):
    """A connection's reads, each within `timeout`, and while a request's line and headers are read (`deadline`
    set), all of them by the deadline: a client sending a byte every 29 s held its connection's slot for good."""

    deadline: float | None = None
    timeout: float = 30.0

    def readinto(self, b: Any) -> int | None:
        left = self.timeout if self.deadline is None else min(self.timeout, self.deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError("the request's head did not arrive in time")
        self._sock.settimeout(left)  # type: ignore[attr-defined]
        return super().readinto(b)


class _Handler(BaseHTTPRequestHandler):
    server_viewer: ViewerServer
    protocol_version = "HTTP/1.1"
    timeout = 30  # a client that stops sending does not hold its thread forever

    def setup(self) -> None:
        super().setup()
        self._reads = _HeadDeadline(self.connection, "rb")
        self._reads.timeout = float(self.timeout)
        self.rfile = io.BufferedReader(self._reads)

    def handle_one_request(self) -> None:
        # an idle keep-alive connection waits for its next request's head as a slow one does, then is closed
        self._reads.deadline = time.monotonic() + HEAD_DEADLINE_S
        super().handle_one_request()

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers
        self._reads.deadline = None  # the head is in: a login form's body is read at `timeout` a read
        self.connection.settimeout(self.timeout)  # and the reply is sent at it (the socket kept the head's time left)
        return parsed

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: str, headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        for k, v in {
            "Content-Type": "text/html; charset=utf-8",
            "Content-Length": str(len(data)),
            "Content-Security-Policy": CSP,
            "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
            **(headers or {}),
        }.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _host_ok(self) -> bool:
        """Without tokens, only loopback Host names: a rebound DNS name must not read the local tenant's data."""
        if self.server_viewer.auth_enabled:
            return True
        host = self.headers.get("Host") or ""
        # "name:port", "[::1]:port" or a bare name: drop the port, keep an IPv6 literal's brackets
        name = host.rpartition("]")[0] + "]" if host.startswith("[") else host.partition(":")[0]
        return name in LOOPBACK_NAMES

    def _authorization(self) -> str | None:
        header = self.headers.get("Authorization")
        if header:
            return header
        try:
            cookie = SimpleCookie(self.headers.get("Cookie") or "")
        except CookieError:
            return None
        morsel = cookie.get(COOKIE)
        return f"Bearer {morsel.value}" if morsel and morsel.value else None

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        viewer = self.server_viewer
        url = urlsplit(self.path)
        if not self._host_ok():
            self._send(HTTPStatus.FORBIDDEN, page("Forbidden", "<p>This viewer answers loopback host names only.</p>"))
            return
        if url.path == "/login":
            self._send(HTTPStatus.OK, _login_page(""))
            return
        try:
            tenant = viewer.tenant_of(self._authorization())
            if not viewer.renders.acquire(timeout=RENDER_WAIT_S):
                raise TimeoutError
            try:
                start = time.perf_counter()
                body = viewer.render(url.path, dict(parse_qsl(url.query)), tenant)
                render_ms = 1000 * (time.perf_counter() - start)
            finally:
                viewer.renders.release()
        except UnauthenticatedError as e:
            self._send(HTTPStatus.UNAUTHORIZED, _login_page(str(e)), {"WWW-Authenticate": "Bearer"})
        except NotFoundError as e:
            self._send(HTTPStatus.NOT_FOUND, page("Not found", f"<p>{esc(e)}</p>"))
        except TimeoutError:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, page("Busy", "<p>The orchestrator did not answer in time.</p>"))
        except Exception:
            log.exception("viewer: %s failed", url.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, page("Error", "<p>The page failed; see the server log.</p>"))
        else:  # the render time shows in the browser's developer tools (Network, Timing)
            self._send(HTTPStatus.OK, body, {"Server-Timing": f"render;dur={render_ms:.1f}"})

    def do_POST(self) -> None:
        """The login form: check the token, then keep it in an HttpOnly, SameSite=Strict cookie."""
        if urlsplit(self.path).path != "/login" or not self._host_ok():
            self._send(HTTPStatus.NOT_FOUND, page("Not found", "<p>Only the login form takes a POST.</p>"))
            return
        if not self._same_origin():
            # another site's page posting its own token would sign this browser in as that tenant (login CSRF)
            self._send(HTTPStatus.FORBIDDEN, _login_page("the form was posted from another site"))
            return
        raw_length = self.headers.get("Content-Length") or "0"
        length = int(raw_length) if raw_length.isdigit() else 0
        if not 0 < length <= MAX_FORM_BYTES:
            self._send(HTTPStatus.BAD_REQUEST, _login_page("the form is empty or too large"))
            return
        token = dict(parse_qsl(self.rfile.read(length).decode("utf-8", "replace"))).get("token", "").strip()
        if not _COOKIE_VALUE.fullmatch(token):
            # it goes into a Set-Cookie header: a CR/LF in it added headers of the sender's (a cookie for every port
            # of this host, a redirect), and without tokens configured any token passed the check below
            self._send(HTTPStatus.BAD_REQUEST, _login_page('a token is visible ASCII without spaces, ; , \\ or "'))
            return
        try:
            self.server_viewer.tenant_of(f"Bearer {token}")
        except UnauthenticatedError as e:
            self._send(HTTPStatus.UNAUTHORIZED, _login_page(str(e)))
            return
        cookie = f"{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/"
        self._send(HTTPStatus.SEE_OTHER, "", {"Location": "/", "Set-Cookie": cookie})

    def _same_origin(self) -> bool:
        """Whether a POST came from this viewer's own page: a browser says where a request came from (Sec-Fetch-Site,
        else Origin); a client that says neither (curl) is no other site's page."""
        site = self.headers.get("Sec-Fetch-Site")
        if site is not None:
            return site in ("same-origin", "none")
        origin = self.headers.get("Origin")
        return origin is None or urlsplit(origin).netloc == (self.headers.get("Host") or "")

    def do_PUT(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, page("Read-only", "<p>The viewer is read-only.</p>"))

    do_DELETE = do_PATCH = do_PUT


def _login_page(problem: str) -> str:
    note = f'<p class="card" id="problem">{esc(problem)}</p>' if problem else ""
    form = (
        '<form method="post" action="/login">bearer token <input name="token" type="password" size="40" '
        'autocomplete="off"> <button type="submit">sign in</button></form>'
    )
    return page("Sign in", note + form)


def start_viewer(
    source: Source,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    tenant_of: TenantOf | None = None,
    auth_enabled: bool = False,
    decoder_for: DecoderFor = _no_decoder,
) -> ViewerServer:
    """A started viewer over `source`."""
    return ViewerServer(source, host, port, tenant_of, auth_enabled, decoder_for).start()


def start_live_viewer(
    jobs: JobManager, db_path: Path, host: str, port: int, tenant_of: TenantOf, auth_enabled: bool
) -> ViewerServer:
    """A started viewer over a running orchestrator (call it on the orchestrator's event loop)."""
    source = LiveSource(jobs, db_path, asyncio.get_running_loop())
    return start_viewer(source, host, port, tenant_of=tenant_of, auth_enabled=auth_enabled)
