"""The facade's ASGI app: one OpenEnv app per environment under `/envs/<name>[@version]`, behind the API's auth.

    GET /health                      no auth: the facade is up
    GET /envs                        the environments the caller may use, with their paths
    WS  /envs/<env>/ws               OpenEnv's session protocol: one envfleet session per connection
    GET /envs/<env>/{health,schema,metadata}

Every other path is 404: OpenEnv's stateless HTTP reset and step (a sandbox opened and dropped per call), its MCP
routes and its task API are not served. Before a request reaches OpenEnv the orchestrator is asked to describe the
environment with the caller's bearer token: the orchestrator's own check decides (401 without a valid token when it
has tokens, 404 for an environment the caller may not see). Without tokens only loopback Host names (and, for a
websocket, no foreign Origin) are answered, so a web page cannot reach the local tenant. Open websockets are capped
in all and per caller; OpenEnv's MCP frames and binary frames get error frames.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

import grpc
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.types import WSErrorCode, WSErrorResponse

from orchestrator.core.echo import echo
from orchestrator.openenv.config import OpenEnvConfig
from orchestrator.openenv.environment import CALLER, Backend, EnvfleetEnvironment, EnvInfo, Metadata, rpc_message
from orchestrator.openenv.models import EnvfleetAction, EnvfleetObservation, EnvfleetState
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PREFIX = "/envs/"
MAX_REF = 200
MAX_APPS = 256  # environments with an app built; the least recently used is dropped (its open sockets go on)
DESCRIBE_TIMEOUT_S = 30.0
HTTP_ROUTES = ("/health", "/schema", "/metadata")
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1", "[::1]"}
BINARY = "binary frames are not part of the protocol: send JSON text frames"
NO_MCP = "MCP is not served here: send reset, step, state or close"

_STATUS_OF_RPC = {
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 503,
}


class _Refused(Exception):
    """A request answered with an HTTP status and a message instead of being served."""

    def __init__(self, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _host_name(value: str) -> str:
    """The name of a Host header ("name:port", "[::1]:port" or a bare name), an IPv6 literal with its brackets."""
    return value.rpartition("]")[0] + "]" if value.startswith("[") else value.partition(":")[0]


def error_frame(message: str, code: WSErrorCode) -> str:
    """An OpenEnv error frame."""
    return str(WSErrorResponse(data={"message": message, "code": code}).model_dump_json())


async def _respond(
    scope: Scope, receive: Receive, send: Send, status: int, body: dict[str, Any], extra: Any = ()
) -> None:
    """A JSON answer; for a websocket, the handshake's refusal (with the same body where the server can send one)."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *extra]
    if scope["type"] == "websocket":
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})  # the client sees HTTP 403
            return
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": data})
        return
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if scope.get("method") == "HEAD" else data})


class FacadeApp:
    """The ASGI app of the facade (see the module's docstring)."""

    def __init__(
        self,
        config: OpenEnvConfig,
        backend: Backend,
        envs: pb_grpc.EnvironmentServiceStub,
        auth_enabled: bool,
        default_token: str | None = None,
    ) -> None:
        self.config = config
        self._backend = backend
        self._envs = envs
        # callers must bring a token when the orchestrator wants one and the facade lends none
        self.callers_need_tokens = auth_enabled and not default_token
        self._default: Metadata = (("authorization", f"Bearer {default_token}"),) if default_token else ()
        self._apps: OrderedDict[str, tuple[Any, EnvInfo]] = OrderedDict()
        self._open: dict[str, int] = {}  # open websockets per caller (a digest of its authorization header)

    @property
    def open_connections(self) -> int:
        """Websockets being served now."""
        return sum(self._open.values())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return  # lifespan: the facade has no startup or shutdown of its own
        try:
            await self._serve(scope, receive, send)
        except _Refused as e:
            await _respond(scope, receive, send, e.status, {"detail": str(e)}, e.headers)

    def _check_local(self, headers: dict[str, str]) -> None:
        """Without tokens from callers, every caller is one tenant: answer loopback names only (no DNS rebinding)
        and no browser page of another origin (browsers let any page open a websocket to localhost)."""
        if self.callers_need_tokens:
            return
        if _host_name(headers.get("host", "")) not in LOOPBACK_NAMES:
            raise _Refused(403, "this OpenEnv facade takes no tokens: it answers loopback host names only")
        origin = headers.get("origin")
        if origin is not None and (urlsplit(origin).hostname or "") not in LOOPBACK_NAMES | {"::1"}:
            raise _Refused(403, f"origin {echo(origin)} may not use this facade (it takes no tokens)")

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = _headers(scope)
        self._check_local(headers)
        path, kind = scope["path"], scope["type"]
        authorization = headers.get("authorization")
        metadata: Metadata = (("authorization", authorization),) if authorization else self._default
        if kind == "http" and path == "/health":
            await _respond(scope, receive, send, 200, {"status": "healthy"})
            return
        if kind == "http" and path.rstrip("/") == PREFIX.rstrip("/"):
            await _respond(scope, receive, send, 200, {"environments": await self._list(metadata)})
            return
        if not path.startswith(PREFIX):
            raise _Refused(404, f"no page {echo(path)}: environments are served under {PREFIX}<name>")
        ref, _, rest = path.removeprefix(PREFIX).partition("/")
        rest = "/" + rest
        if not ref or len(ref) > MAX_REF:
            raise _Refused(404, f"no environment {echo(ref)}")
        if (kind == "websocket" and rest != "/ws") or (kind == "http" and rest not in HTTP_ROUTES):
            raise _Refused(404, f"{PREFIX}{echo(ref)} serves the websocket /ws and GET {', '.join(HTTP_ROUTES)}")
        if kind == "http" and scope.get("method") not in ("GET", "HEAD"):
            raise _Refused(405, "only GET here: episodes run over the websocket /ws", ((b"allow", b"GET, HEAD"),))
        app = self._app_for(ref, await self._describe(ref, metadata))
        child = dict(scope, root_path=scope.get("root_path", "") + PREFIX + ref)
        if kind == "http":
            await app(child, receive, send)
            return
        if "session_id" in parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True):
            # OpenEnv attaches a websocket to a live session named so: its episode ran on with this caller's frames
            # and the first caller's token, and a reset over it opened a session no websocket's end closed
            raise _Refused(400, "session_id: each websocket runs its own episodes; open one and send reset")
        caller = _caller(authorization)
        if self.open_connections >= self.config.max_connections:
            raise _Refused(503, f"the facade serves {self.config.max_connections} websockets at most; try later")
        if self._open.get(caller, 0) >= self.config.max_connections_per_caller:
            raise _Refused(429, f"{self.config.max_connections_per_caller} websockets are open with this token")
        self._open[caller] = self._open.get(caller, 0) + 1
        token = CALLER.set(metadata)  # read by EnvfleetEnvironment on this connection's task
        try:
            await app(child, _guarded(receive, send, self.config.idle_timeout_s), _explained(send))
        finally:
            CALLER.reset(token)
            self._open[caller] -= 1
            if not self._open[caller]:
                del self._open[caller]

    async def _list(self, metadata: Metadata) -> list[dict[str, str]]:
        try:
            r = await self._envs.List(pb.ListEnvironmentsRequest(), timeout=DESCRIBE_TIMEOUT_S, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise _refusal(e) from None
        return [
            {
                "name": e.name,
                "version": e.version,
                "description": e.description,
                "path": f"{PREFIX}{e.name}@{e.version}",
            }
            for e in r.environments
        ]

    async def _describe(self, ref: str, metadata: Metadata) -> pb.EnvironmentInfo:
        """The orchestrator's description of `ref` for this caller; its answer is the access check."""
        try:
            info: pb.EnvironmentInfo = await self._envs.Describe(
                pb.DescribeEnvironmentRequest(name=ref), timeout=DESCRIBE_TIMEOUT_S, metadata=metadata
            )
        except grpc.aio.AioRpcError as e:
            raise _refusal(e) from None
        return info

    def _app_for(self, ref: str, described: pb.EnvironmentInfo) -> Any:
        """The OpenEnv app of `ref` (built on first use), its description refreshed."""
        entry = self._apps.get(ref)
        if entry is None:
            info = EnvInfo(ref)
            factory = functools.partial(EnvfleetEnvironment, self._backend, info)
            app = create_fastapi_app(
                factory,
                EnvfleetAction,
                EnvfleetObservation,
                max_concurrent_envs=self.config.max_connections,
                env_name=ref,
                state_cls=EnvfleetState,
                mode="production",  # no stateless HTTP reset/step: episodes run over /ws
            )
            entry = self._apps[ref] = (app, info)
            while len(self._apps) > MAX_APPS:
                self._apps.popitem(last=False)
        self._apps.move_to_end(ref)
        app, info = entry
        info.name, info.version, info.description = described.name, described.version, described.description
        return app


def _refusal(e: grpc.aio.AioRpcError) -> _Refused:
    status = _STATUS_OF_RPC.get(e.code(), 502)
    extra = ((b"www-authenticate", b"Bearer"),) if status == 401 else ()
    return _Refused(status, rpc_message(e), extra)


def _guarded(receive: Receive, send: Send, idle_timeout_s: float) -> Receive:
    """`receive` for OpenEnv's websocket handler: frames it must not see are answered here with an error frame.

    A binary frame would end OpenEnv's session with an opaque error; an "mcp" frame would reach OpenEnv's MCP
    handler, which can open sessions outside the websocket's lifetime. The handler waits on `receive` before it
    sends, so answering here never interleaves with its own frames. A client silent for `idle_timeout_s` between
    frames is closed (1001), which ends its session."""

    async def guarded() -> Message:
        while True:
            try:
                # the handler waits here between frames only (never during a reset or step)
                async with asyncio.timeout(idle_timeout_s):
                    message = await receive()
            except TimeoutError:
                await send({"type": "websocket.close", "code": 1001, "reason": "idle for too long"})
                return {"type": "websocket.disconnect", "code": 1001}
            if message["type"] != "websocket.receive":
                return message
            text = message.get("text")
            if text is None:
                await send(
                    {"type": "websocket.send", "text": error_frame("send JSON text frames", WSErrorCode.INVALID_JSON)}
                )
                continue
            # parsed whenever it could say "mcp": written plainly, or with an escape ("\u006dcp" is "mcp" too)
            if ("mcp" in text or "\\" in text) and _frame_type(text) == "mcp":
                refusal = error_frame(
                    "MCP is not served here: send reset, step, state or close", WSErrorCode.UNKNOWN_TYPE
                )
                await send({"type": "websocket.send", "text": refusal})
                continue
            return message

    return guarded


def _explained(send: Send) -> Send:
    """`send` for OpenEnv's websocket handler: a validation error frame says which field is wrong in its message
    (OpenEnv's says "Invalid message" and lists the errors beside it, which its own client does not show)."""

    async def explained(message: Message) -> None:
        text = message.get("text") if message["type"] == "websocket.send" else None
        if text is not None and text.startswith('{"type":"error"'):
            message = {**message, "text": _explain(text)}
        await send(message)

    return explained


def _explain(text: str) -> str:
    try:
        data = json.loads(text)["data"]
    except (ValueError, KeyError, TypeError):
        return text
    errors = data.get("errors") if isinstance(data, dict) else None
    if data.get("code") != WSErrorCode.VALIDATION_ERROR or not isinstance(errors, list) or not errors:
        return text
    parts = []
    for err in (e for e in errors[:5] if isinstance(e, dict)):
        where = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{where}: {err.get('msg', '')}" if where else str(err.get("msg", "")))
    message = f"{data.get('message', 'Invalid message')}: {'; '.join(parts)}"[:2000]
    return json.dumps({"type": "error", "data": {**data, "message": message}})


def _caller(authorization: str | None) -> str:
    """Whom a websocket counts against: its bearer token as the orchestrator reads it (the scheme in any case, spaces
    around the token), so that the ways of writing one token are one caller."""
    value = authorization or ""
    scheme, _, token = value.strip().partition(" ")
    return hashlib.sha256((token.strip() if scheme.lower() == "bearer" else value).encode()).hexdigest()


def _frame_type(text: str) -> object:
    try:
        frame = json.loads(text)
    except (ValueError, RecursionError):
        return None  # OpenEnv answers INVALID_JSON itself
    return frame.get("type") if isinstance(frame, dict) else None
