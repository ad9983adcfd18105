"""A scripted OpenAI-compatible chat completions server: the stand-in for vLLM in demos and tests.

It replays a Script: per task, one Step per assistant turn (text, tool calls, or a fault: an HTTP error status or a
hang). The task comes from the request's `user` field, the rollout id "<job_id>:<task_id>:<sample_index>"; the turn is
the number of assistant messages already in the conversation. Token ids and logprobs come from the toy tokenizer, in
vLLM's response fields, so a client can be checked token for token.

The app is a plain ASGI callable (ScriptedPolicyApp) served by uvicorn, as vLLM's own server is; HTTP parsing,
keep-alive and flow control are uvicorn's. Measured against the hand-written asyncio server it replaced (same host,
same run, `python -m bench.policy_server`), it costs no more per request; the figures are in bench/policy_server.py.

    python -m orchestrator.testing.scripted_policy --script script.json [--port 0] [--host 127.0.0.1] [--no-tokens]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any, Literal

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from orchestrator.testing import toy_tokenizer as toy

log = logging.getLogger(__name__)

NO_SCRIPT_ANSWER = "I cannot solve this."
END_OF_SCRIPT_ANSWER = "done"
MAX_BODY = 64 << 20
LISTEN_BACKLOG = 1024
CLOSE_GRACE_S = 2.0
# Idle keep-alive connections are closed after this long. vLLM's uvicorn uses 5 s; a test double waits longer, so a
# slow test never races the server's close of a pooled connection.
KEEP_ALIVE_S = 300
START_TIMEOUT_S = 10.0

Template = Literal["prefix", "drop_history"]

# ASGI's three callables and its message type; uvicorn's own aliases are not public.
Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ScriptedToolCall(BaseModel):
    """A tool call the scripted model makes; arguments are sent as their JSON text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class Step(BaseModel):
    """One assistant turn: text and tool calls, or a fault (an HTTP error status, or never answering)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    content: str = ""
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    finish_reason: str | None = Field(None, description="override, e.g. 'length'; default: tool_calls or stop")
    error_status: int | None = Field(None, ge=400, le=599, description="answer this HTTP status instead")
    hang: bool = Field(False, description="never answer; hold the connection until the client gives up")
    fail_times: int | None = Field(
        None, ge=1, description="the fault hits only this many attempts, then the turn answers normally; None: always"
    )

    @model_validator(mode="after")
    def _one_fault(self) -> Step:
        if self.error_status is not None and self.hang:
            raise ValueError("a step is either an error_status or a hang, not both")
        if self.fail_times is not None and self.error_status is None and not self.hang:
            raise ValueError("fail_times needs a fault (error_status or hang)")
        return self


class Script(BaseModel):
    """What the scripted policy answers: steps per task id, steps for any other task, simulated latency."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: dict[str, list[Step]] = Field(default_factory=dict)
    default: list[Step] = Field(default_factory=list, description="for tasks not in `tasks`")
    latency_s: float = Field(0.0, ge=0, le=3600, description="simulated latency of every completion")
    model: str = Field("policy", min_length=1, description="the model id /v1/models lists")
    template: Template = Field(
        "prefix",
        description="how the prompt is rendered. prefix: every turn's prompt extends the previous prompt and "
        "completion. drop_history: earlier assistant turns render empty, as reasoning models' chat templates drop "
        "earlier thinking, so a later prompt does NOT extend the earlier one (token arrays become inconsistent)",
    )


def task_of(user: str) -> str | None:
    """The task id in a rollout id "<job_id>:<task_id>:<sample_index>" (task ids may contain ':'), else None."""
    first, last = user.find(":"), user.rfind(":")
    if first < 0 or last == first:
        return None
    return user[first + 1 : last]


def render_prompt(messages: list[dict[str, Any]], template: Template) -> list[int]:
    """The prompt token ids of a conversation under a template (ValueError for a message the toy cannot render)."""
    if template == "drop_history":
        messages = [{"role": "assistant", "content": ""} if m.get("role") == "assistant" else m for m in messages]
    return toy.prompt_ids(messages)


class _HTTPError(Exception):
    """Answer this status with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _error_body(status: int, message: str, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(scope: Scope, receive: Receive) -> bytes | None:
    """The request body (at most MAX_BODY bytes), or None when the client went away first."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > MAX_BODY:
            raise _HTTPError(413, f"body over {MAX_BODY} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk: bytes = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise _HTTPError(413, f"body over {MAX_BODY} bytes")
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


class _Hang:
    """The scripted turn never answers."""


_HANG = _Hang()


class ScriptedPolicyApp:
    """The ASGI app: routes, script replay, faults, token fields; counts chat completion requests and faults."""

    def __init__(self, script: Script, *, tokens: bool = True) -> None:
        self.script = script
        self.tokens = tokens
        self.requests = 0
        self.faults = 0
        self._failures: dict[tuple[str, int], int] = {}
        self._ids = itertools.count(1)
        self._closing = asyncio.Event()

    def close(self) -> None:
        """Answer every waiting request (latency, hang) at once with 503, so a server can shut down promptly."""
        self._closing.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point: HTTP only (lifespan is answered, websockets refused)."""
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # the server closes a websocket the app does not accept
        try:
            reply = await self._route(scope, receive)
        except _HTTPError as e:
            reply = e.status, _error_body(e.status, str(e), e.kind)
        except Exception as e:  # a bug here must answer 500, not leave the client waiting
            log.exception("scripted server failed on %s %s", scope["method"], scope["path"])
            reply = 500, _error_body(500, f"{type(e).__name__}: {e}", "InternalServerError")
        if reply is not None:
            await _send_json(send, *reply)

    async def _route(self, scope: Scope, receive: Receive) -> tuple[int, dict[str, Any]] | None:
        path, method = scope["path"], scope["method"]
        if path == "/v1/chat/completions":
            allowed = "POST"
        elif path in ("/v1/models", "/health"):
            allowed = "GET"
        else:
            raise _HTTPError(404, f"no route {path}", "NotFoundError")
        if method != allowed:
            raise _HTTPError(405, f"{path} takes {allowed}, not {method}", "MethodNotAllowed")
        if path == "/health":
            return 200, {"status": "ok"}
        if path == "/v1/models":
            card = {"id": self.script.model, "object": "model", "created": 0, "owned_by": "envfleet"}
            return 200, {"object": "list", "data": [card]}
        return await self._chat(scope, receive)

    async def _chat(self, scope: Scope, receive: Receive) -> tuple[int, dict[str, Any]] | None:
        # the simulated latency is the whole answer time, this server's own work included, as a model server's is
        loop = asyncio.get_running_loop()
        answer_at = loop.time() + self.script.latency_s
        raw = await _read_body(scope, receive)
        if raw is None:
            return None
        self.requests += 1
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _HTTPError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _HTTPError(400, "request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _HTTPError(400, "'messages' must be a non-empty list of objects")
        user = body["user"] if isinstance(body.get("user"), str) else ""
        try:
            prompt = render_prompt(messages, self.script.template)
        except ValueError as e:
            raise _HTTPError(400, str(e)) from None

        turn = sum(1 for m in messages if m.get("role") == "assistant")
        step = self._step(user, turn)
        reply = self._fault(user, turn, step) or (200, self._completion(body, step, turn, prompt))
        if isinstance(reply, _Hang):
            return await self._hang(receive)
        delay = answer_at - loop.time()
        if delay > 0 and not await self._wait_closing(delay):
            return reply
        if self._closing.is_set():
            return 503, _error_body(503, "the scripted server is shutting down", "ServiceUnavailable")
        return reply

    async def _wait_closing(self, timeout_s: float) -> bool:
        """Sleep timeout_s or until close(); True when it was close()."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._closing.wait()
        except TimeoutError:
            return False
        return True

    async def _hang(self, receive: Receive) -> tuple[int, dict[str, Any]] | None:
        """Hold the request unanswered until the client hangs up (None) or the server closes (503)."""
        gone = asyncio.ensure_future(_disconnected(receive))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({gone, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (gone, closing):
                f.cancel()
        if gone.done() and not gone.cancelled():
            return None
        return 503, _error_body(503, "the scripted server is shutting down", "ServiceUnavailable")

    def _fault(self, user: str, turn: int, step: Step) -> tuple[int, dict[str, Any]] | _Hang | None:
        """The scripted failure of this turn, if it still has one to give."""
        if step.error_status is None and not step.hang:
            return None
        key = (user, turn)
        failed = self._failures.get(key, 0)
        if step.fail_times is not None and failed >= step.fail_times:
            return None
        self._failures[key] = failed + 1
        self.faults += 1
        if step.hang:
            return _HANG
        assert step.error_status is not None
        msg = f"scripted fault: HTTP {step.error_status} (turn {turn})"
        return step.error_status, _error_body(step.error_status, msg, "ScriptedFault")

    def _step(self, user: str, turn: int) -> Step:
        task = task_of(user)
        if task is not None and task in self.script.tasks:
            steps = self.script.tasks[task]
        elif self.script.default:
            steps = self.script.default
        else:
            return Step(content=NO_SCRIPT_ANSWER)
        return steps[turn] if turn < len(steps) else Step(content=END_OF_SCRIPT_ANSWER)

    def _completion(self, body: dict[str, Any], step: Step, turn: int, prompt: list[int]) -> dict[str, Any]:
        tool_calls = [
            {
                "id": f"call_{turn}_{i}",
                "type": "function",
                "function": {"name": tc.name, "arguments": json.dumps(tc.arguments)},
            }
            for i, tc in enumerate(step.tool_calls)
        ]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": step.content if step.content or not tool_calls else None,
            "tool_calls": tool_calls,
        }
        completion = toy.completion_ids(message)
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": step.finish_reason or ("tool_calls" if tool_calls else "stop"),
        }
        model = body.get("model") if isinstance(body.get("model"), str) else self.script.model
        response: dict[str, Any] = {
            "id": f"chatcmpl-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion),
                "total_tokens": len(prompt) + len(completion),
            },
        }
        if self.tokens and body.get("return_token_ids") is True:
            response["prompt_token_ids"] = prompt
            choice["token_ids"] = completion
        if self.tokens and body.get("logprobs") is True:
            as_ids = body.get("return_tokens_as_token_ids") is True
            choice["logprobs"] = {
                "content": [
                    {
                        "token": f"token_id:{t}" if as_ids else toy.token_text(t),
                        "logprob": toy.logprob(t, i),
                        "bytes": toy.token_bytes(t),
                        "top_logprobs": [],
                    }
                    for i, t in enumerate(completion)
                ]
            }
        return response


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: library code installs none (the CLI's _serve handles SIGTERM/SIGINT)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Capture nothing."""
        yield


def _bind(host: str, port: int) -> socket.socket:
    # Bound here, not by uvicorn: the port is known before serving starts, and a bind error raises OSError instead
    # of uvicorn's sys.exit.
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class ScriptedServer:
    """A running scripted server (uvicorn serving ScriptedPolicyApp); counts chat completion requests and faults."""

    def __init__(self, script: Script, *, tokens: bool = True) -> None:
        self.app = ScriptedPolicyApp(script, tokens=tokens)
        self._host = "127.0.0.1"
        self._port = 0
        self._uvicorn: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def script(self) -> Script:
        """The script being replayed."""
        return self.app.script

    @property
    def tokens(self) -> bool:
        """Whether token ids and logprobs are returned when asked for."""
        return self.app.tokens

    @property
    def requests(self) -> int:
        """Chat completion requests received (faults included)."""
        return self.app.requests

    @property
    def faults(self) -> int:
        """Scripted faults answered (error statuses and hangs)."""
        return self.app.faults

    async def _start(self, host: str, port: int) -> None:
        sock = _bind(host, port)
        self._host, self._port = host, int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            http="auto",  # httptools when installed, else h11
            ws="none",
            lifespan="off",
            log_config=None,  # logging is the embedding program's business
            access_log=False,
            server_header=False,
            date_header=False,
            backlog=LISTEN_BACKLOG,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=int(CLOSE_GRACE_S),
        )
        self._uvicorn = _Uvicorn(config)
        self._task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]), name=f"scripted-policy:{self._port}")
        # uvicorn has no started event; startup is a create_server on a bound socket, so this polls a few ms at most
        async with asyncio.timeout(START_TIMEOUT_S):
            while not self._uvicorn.started:
                if self._task.done():
                    sock.close()
                    self._task.result()
                    raise RuntimeError("the scripted server stopped while starting")
                await asyncio.sleep(0.001)

    @property
    def port(self) -> int:
        """The bound TCP port."""
        if self._task is None or self._task.done():
            raise RuntimeError("the scripted server is not listening")
        return self._port

    @property
    def url(self) -> str:
        """The OpenAI base URL, http://HOST:PORT/v1."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self._host, self._host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/v1"

    async def close(self) -> None:
        """Stop listening, answer waiting requests (latency, hangs) with 503, and close every connection."""
        if self._uvicorn is None or self._task is None:
            return
        self.app.close()
        self._uvicorn.should_exit = True
        await self._task

    async def __aenter__(self) -> ScriptedServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_scripted_server(
    script: Script, host: str = "127.0.0.1", port: int = 0, *, tokens: bool = True
) -> ScriptedServer:
    """Start serving script on host:port (0: any free port); tokens=False never returns token ids or logprobs."""
    server = ScriptedServer(script, tokens=tokens)
    await server._start(host, port)
    return server


async def _serve(args: argparse.Namespace, script: Script) -> None:
    server = await start_scripted_server(script, args.host, args.port, tokens=not args.no_tokens)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: serve a script file until SIGTERM or SIGINT."""
    p = argparse.ArgumentParser(
        prog="python -m orchestrator.testing.scripted_policy", description="Serve a scripted OpenAI-compatible policy."
    )
    p.add_argument("--script", required=True, help="a Script as JSON")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument("--no-tokens", action="store_true", help="never return token ids or logprobs")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with open(args.script, encoding="utf-8") as f:
            script = Script.model_validate_json(f.read())
    except (OSError, ValidationError) as e:
        print(f"error: cannot load script {args.script}: {e}", file=sys.stderr)
        return 2
    asyncio.run(_serve(args, script))
    return 0


if __name__ == "__main__":
    sys.exit(main())
