"""A scripted OpenAI-compatible chat completions server: the stand-in for vLLM in demos and tests.

It replays a Script: per task, one Step per assistant turn (text, tool calls, or a fault: an HTTP error status or a
hang). The task comes from the request's `user` field, the rollout id "<job_id>:<task_id>:<sample_index>"; the turn is
the number of assistant messages already in the conversation. Token ids and logprobs come from the toy tokenizer, in
vLLM's response fields, so a client can be checked token for token.

    python -m orchestrator.scripted_policy --script script.json [--port 0] [--host 127.0.0.1] [--no-tokens]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http
import itertools
import json
import logging
import signal
import sys
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from orchestrator.testing import toy_tokenizer as toy

log = logging.getLogger(__name__)

NO_SCRIPT_ANSWER = "I cannot solve this."
END_OF_SCRIPT_ANSWER = "done"
MAX_HEADER_LINE = 64 << 10
MAX_HEADERS = 100
MAX_BODY = 64 << 20
LISTEN_BACKLOG = 1024
CLOSE_GRACE_S = 2.0


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


def task_of(user: str) -> str | None:
    """The task id in a rollout id "<job_id>:<task_id>:<sample_index>" (task ids may contain ':'), else None."""
    first, last = user.find(":"), user.rfind(":")
    if first < 0 or last == first:
        return None
    return user[first + 1 : last]


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "path")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes, keep_alive: bool) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive


class _Hang(Exception):
    """The scripted turn never answers."""


_HANG: tuple[int, dict[str, Any]] = (0, {})  # _fault's answer for a turn that never answers (compared by identity)


def _error_body(status: int, message: str, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


async def _readline(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readline()
    except ValueError:  # the stream's limit: a line longer than MAX_HEADER_LINE
        raise _HTTPError(431, f"request line or header over {MAX_HEADER_LINE} bytes") from None


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    """One HTTP/1.1 request, or None at a clean end of the connection."""
    line = b"\r\n"
    while line in (b"\r\n", b"\n"):  # tolerate blank lines between requests
        line = await _readline(reader)
        if not line:
            return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _HTTPError(400, "malformed request line")
    method, target, version = parts
    headers: dict[str, str] = {}
    while True:
        h = await _readline(reader)
        if not h:
            raise asyncio.IncompleteReadError(h, None)
        if h in (b"\r\n", b"\n"):
            break
        if len(headers) >= MAX_HEADERS:
            raise _HTTPError(431, "too many headers")
        name, sep, value = h.decode("latin-1").partition(":")
        if not sep:
            raise _HTTPError(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _HTTPError(501, "chunked request bodies are not supported; send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise _HTTPError(400, "bad Content-Length") from None
    if length < 0:
        raise _HTTPError(400, "bad Content-Length")
    if length > MAX_BODY:
        raise _HTTPError(413, f"body over {MAX_BODY} bytes")
    body = await reader.readexactly(length) if length else b""
    conn = headers.get("connection", "").lower()
    keep_alive = "close" not in conn if version == "HTTP/1.1" else "keep-alive" in conn
    return _Request(method, target.split("?", 1)[0], headers, body, keep_alive)


def _encode_response(status: int, payload: dict[str, Any], keep_alive: bool) -> bytes:
    body = json.dumps(payload).encode()
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    return head.encode("latin-1") + body


class ScriptedServer:
    """A running scripted server; counts the chat completion requests it got and the faults it answered."""

    def __init__(self, script: Script, *, tokens: bool = True) -> None:
        self.script = script
        self.tokens = tokens
        self.requests = 0
        self.faults = 0
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._failures: dict[tuple[str, int], int] = {}
        self._ids = itertools.count(1)
        self._host = "127.0.0.1"

    async def _start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(
            self._serve_connection, host, port, limit=MAX_HEADER_LINE, backlog=LISTEN_BACKLOG
        )
        self._host = host

    @property
    def port(self) -> int:
        """The bound TCP port."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("the scripted server is not listening")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        """The OpenAI base URL, http://HOST:PORT/v1."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self._host, self._host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/v1"

    async def close(self) -> None:
        """Stop listening and drop every open connection, hanging ones included."""
        if self._server is not None:
            self._server.close()
        # Closing the transports ends every handler at its next read or write (a hang sees EOF); cancelling is the
        # fallback, as asyncio 3.11 logs a cancelled connection handler as an error.
        for writer in self._connections.values():
            writer.close()
        if self._connections:
            _, stuck = await asyncio.wait(set(self._connections), timeout=CLOSE_GRACE_S)
            for task in stuck:
                task.cancel()
            if stuck:
                await asyncio.wait(stuck)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> ScriptedServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            while True:
                try:
                    req = await _read_request(reader)
                except _HTTPError as e:
                    writer.write(_encode_response(e.status, _error_body(e.status, str(e)), keep_alive=False))
                    await writer.drain()
                    return
                if req is None:
                    return
                try:
                    status, payload = await self._route(req)
                except _Hang:
                    # Hold the connection without answering; end when the client hangs up.
                    while await reader.read(1 << 16):
                        pass
                    return
                except Exception as e:  # a bug here must answer 500, not leave the client waiting
                    log.exception("scripted server failed on %s %s", req.method, req.path)
                    status, payload = 500, _error_body(500, f"{type(e).__name__}: {e}", "InternalServerError")
                writer.write(_encode_response(status, payload, req.keep_alive))
                await writer.drain()
                if not req.keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            log.debug("connection ended: %s: %s", type(e).__name__, e)
        finally:
            writer.close()
            try:
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
            finally:
                self._connections.pop(task, None)  # only now: close() waits for the handlers it still lists

    async def _route(self, req: _Request) -> tuple[int, dict[str, Any]]:
        routes = {
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/models": ("GET", self._models),
            "/health": ("GET", self._health),
        }
        if req.path not in routes:
            return 404, _error_body(404, f"no route {req.path}", "NotFoundError")
        method, handler = routes[req.path]
        if req.method != method:
            return 405, _error_body(405, f"{req.path} takes {method}, not {req.method}", "MethodNotAllowed")
        return await handler(req)

    async def _health(self, req: _Request) -> tuple[int, dict[str, Any]]:
        return 200, {"status": "ok"}

    async def _models(self, req: _Request) -> tuple[int, dict[str, Any]]:
        card = {"id": self.script.model, "object": "model", "created": 0, "owned_by": "envfleet"}
        return 200, {"object": "list", "data": [card]}

    async def _chat(self, req: _Request) -> tuple[int, dict[str, Any]]:
        # the simulated latency is the whole answer time, this server's own work included, as a model server's is
        loop = asyncio.get_running_loop()
        answer_at = loop.time() + self.script.latency_s
        self.requests += 1
        try:
            body = json.loads(req.body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return 400, _error_body(400, f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return 400, _error_body(400, "request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return 400, _error_body(400, "'messages' must be a non-empty list of objects")
        user = body["user"] if isinstance(body.get("user"), str) else ""
        try:
            prompt = toy.prompt_ids(messages)
        except ValueError as e:
            return 400, _error_body(400, str(e))

        turn = sum(1 for m in messages if m.get("role") == "assistant")
        step = self._step(user, turn)
        reply = self._fault(user, turn, step) or (200, self._completion(body, step, turn, prompt))
        await asyncio.sleep(max(0.0, answer_at - loop.time()))
        if reply is _HANG:
            raise _Hang
        return reply

    def _fault(self, user: str, turn: int, step: Step) -> tuple[int, dict[str, Any]] | None:
        """The scripted failure of this turn, if it still has one to give (_HANG: never answer)."""
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
        prog="python -m orchestrator.scripted_policy", description="Serve a scripted OpenAI-compatible policy."
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
