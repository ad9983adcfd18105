"""The scripted policy as an ASGI app: OpenAI-compatible routes, script replay, faults, vLLM-style token fields.

Any ASGI server can serve it; ScriptedServer (scripted_policy.py) serves it with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from orchestrator.testing import qwen_policy as qwen
from orchestrator.testing import toy_tokenizer as toy
from orchestrator.testing.policy_script import Script, Step, render_prompt, task_of
from orchestrator.testing.qwen_policy import QwenLikeModel, Sample

log = logging.getLogger(__name__)

NO_SCRIPT_ANSWER = "I cannot solve this."
END_OF_SCRIPT_ANSWER = "done"
MAX_BODY = 64 << 20
# the steps answered when the script has none for a task or turn
NO_SCRIPT_STEP = Step(content=NO_SCRIPT_ANSWER)
END_OF_SCRIPT_STEP = Step(content=END_OF_SCRIPT_ANSWER)
MAX_CACHED_ANSWERS = 4096

# What a request turns into once parsed: its turn, and how to answer the Step scripted for it.
_Request = tuple[int, Callable[[Step], dict[str, Any]]]

# ASGI's three callables and its message type; uvicorn's own aliases are not public.
Message = MutableMapping[str, Any]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class _HTTPError(Exception):
    """Answer this status with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _error_body(status: int, message: str, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


async def _send_json(send: Send, status: int, payload: dict[str, Any] | bytes) -> None:
    if isinstance(payload, bytes):
        body = payload
    else:
        try:
            body = orjson.dumps(payload)  # a tenth of json.dumps's time on an answer's per-token logprobs
        except TypeError:  # a lone surrogate (from a request's own JSON) orjson refuses: escaped as json.dumps does
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


STREAM_PIECES = 8  # a streamed answer comes in this many chunks (fewer for a shorter one)


@dataclass
class _Streamed:
    """A whole answer to send as server-sent events, as vLLM streams one (`"stream": true`), `delay_s` apart; with
    `usage` (stream_options.include_usage) a last chunk says how many tokens were sampled."""

    response: dict[str, Any]
    delay_s: float
    usage: bool = False

    async def send(self, send: Send, closing: asyncio.Event) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i, chunk in enumerate(stream_chunks(self.response, usage=self.usage)):
            if i and self.delay_s and not closing.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.delay_s):
                        await closing.wait()
            # json, not orjson: a hostile step's NaN and big ints go out as they are
            event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _cut(seq: Any, n: int) -> list[Any]:
    """`seq` (a string or a list; anything else whole, first) in n consecutive pieces."""
    if not isinstance(seq, str | list):
        return [seq] + [None] * (n - 1)
    size = -(-len(seq) // n) if seq else 0
    return [seq[i * size : (i + 1) * size] for i in range(n)]


def stream_chunks(response: dict[str, Any], *, usage: bool = False) -> list[dict[str, Any]]:
    """The chunks vLLM would stream for a whole chat completion or completion: a chat answer's role alone first
    (with the prompt ids), then its text, tool call arguments, token ids and logprobs cut into consecutive pieces,
    the finish reason on the last; with `usage`, a chunk of no choices that carries the token counts."""
    choice = response["choices"][0]
    ids = choice.get("token_ids")
    n = max(1, min(STREAM_PIECES, len(ids) if isinstance(ids, list) else STREAM_PIECES))
    chat = "message" in choice
    texts = _cut((choice["message"].get("content") or "") if chat else choice.get("text", ""), n)
    lp = choice.get("logprobs")
    lp_pieces = {k: _cut(v, n) for k, v in lp.items()} if isinstance(lp, dict) else {}
    extra = {k: v for k, v in choice.items() if k not in ("message", "text", "logprobs", "token_ids", "finish_reason")}
    chunks: list[dict[str, Any]] = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        first = {"id": response.get("id"), "object": "chat.completion.chunk", "model": response.get("model")}
        first["choices"] = [role]
        if "prompt_token_ids" in response:
            first["prompt_token_ids"] = response["prompt_token_ids"]
        chunks.append(first)
    for i in range(n):
        piece: dict[str, Any] = {"index": 0, "finish_reason": choice.get("finish_reason") if i == n - 1 else None}
        if chat:
            delta: dict[str, Any] = {"content": texts[i]}
            calls = []
            for j, call in enumerate(choice["message"].get("tool_calls") or []):
                fn = call["function"]
                part: dict[str, Any] = {"index": j, "function": {"arguments": _cut(fn["arguments"], n)[i]}}
                if i == 0:
                    part.update(id=call["id"], type="function")
                    part["function"]["name"] = fn["name"]
                calls.append(part)
            if calls:
                delta["tool_calls"] = calls
            piece["delta"] = delta
        else:
            piece["text"] = texts[i]
        if isinstance(ids, list):
            piece["token_ids"] = _cut(ids, n)[i]
        elif ids is not None and i == 0:
            piece["token_ids"] = ids  # a hostile step's value, whole
        if lp_pieces:
            piece["logprobs"] = {k: v[i] for k, v in lp_pieces.items() if v[i] is not None}
        if i == 0:
            piece.update(extra)  # prompt_token_ids of a completion, a hostile step's other fields
        chunk: dict[str, Any] = {
            "id": response.get("id"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "model": response.get("model"),
            "choices": [piece],
        }
        chunks.append(chunk)
    if usage and isinstance(response.get("usage"), dict):
        chunks.append(
            {"id": response.get("id"), "model": response.get("model"), "choices": [], "usage": response["usage"]}
        )
    return chunks


@dataclass
class _Answer:
    """What a step answers at a turn, the same for every request that reaches it: the message, its completion token
    ids, and the per-token logprob entries (made on first use, with tokens as ids or as text)."""

    message: dict[str, Any]
    completion: list[int]
    finish_reason: str
    entries: dict[bool, list[dict[str, Any]]] = field(default_factory=dict)

    def logprob_entries(self, as_ids: bool) -> list[dict[str, Any]]:
        """The logprobs content: each token's id or text, logprob and bytes."""
        cached = self.entries.get(as_ids)
        if cached is None:
            cached = self.entries[as_ids] = [
                {
                    "token": f"token_id:{t}" if as_ids else toy.token_text(t),
                    "logprob": toy.logprob(t, i),
                    "bytes": toy.token_bytes(t),
                    "top_logprobs": [],
                }
                for i, t in enumerate(self.completion)
            ]
        return cached


_HANG = _Hang()


class ScriptedPolicyApp:
    """The ASGI app: routes, script replay, faults, token fields; counts completion requests and faults.

    With the qwen3 template it also serves /v1/completions and logs every sample it answers (`samples`)."""

    def __init__(self, script: Script, *, tokens: bool = True) -> None:
        self.script = script
        self.tokens = tokens
        self.requests = 0
        self.faults = 0
        self.streamed = 0  # answers sent as a stream
        self.samples: list[Sample] = []
        self._model: QwenLikeModel | None = None
        self._failures: dict[tuple[str, int], int] = {}
        self._ids = itertools.count(1)
        self._closing = asyncio.Event()
        self._answers: dict[tuple[Any, ...], _Answer] = {}  # (turn, content, finish, tool calls) -> the answer

    @property
    def model(self) -> QwenLikeModel:
        """The Qwen-like model of the qwen3 template, loaded on first use (blocking: call load_model off the loop)."""
        if self._model is None:
            self.load_model()
        assert self._model is not None
        return self._model

    def load_model(self) -> None:
        """Load the Qwen-like tokenizer when the template is qwen3 (imports transformers); a no-op otherwise."""
        if self.script.template == "qwen3" and self._model is None:
            self._model = QwenLikeModel()

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
        if reply is None:
            return
        status, payload = reply
        if isinstance(payload, _Streamed):
            await payload.send(send, self._closing)
        else:
            await _send_json(send, status, payload)

    async def _route(self, scope: Scope, receive: Receive) -> tuple[int, dict[str, Any] | bytes | _Streamed] | None:
        path, method = scope["path"], scope["method"]
        if path in ("/v1/chat/completions", "/v1/completions"):
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
            card: dict[str, Any] = {"id": self.script.model, "object": "model", "created": 0, "owned_by": "envfleet"}
            if self.script.max_model_len is not None:
                card["max_model_len"] = self.script.max_model_len
            return 200, {"object": "list", "data": [card]}
        if path == "/v1/completions" and self.script.template != "qwen3":
            raise _HTTPError(404, "no route /v1/completions: only the qwen3 template serves token-id prompts")
        return await self._generate(scope, receive, path)

    async def _generate(
        self, scope: Scope, receive: Receive, path: str
    ) -> tuple[int, dict[str, Any] | bytes | _Streamed] | None:
        # the simulated latency is the whole answer time, this server's own work included, as a model server's is
        loop = asyncio.get_running_loop()
        start = loop.time()
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
        user = body["user"] if isinstance(body.get("user"), str) else ""
        try:
            if path == "/v1/completions":
                turn, answer = self._qwen_completions(body, user)
            elif self.script.template == "qwen3":
                turn, answer = self._qwen_chat(body, user)
            else:
                turn, answer = self._toy_chat(body)
        except ValueError as e:
            raise _HTTPError(400, str(e)) from None

        step = self._step(user, turn)
        reply: tuple[int, dict[str, Any] | bytes | _Streamed] | _Hang
        reply = self._fault(user, turn, step) or (200, _with_choice_fields(answer(step), step.choice_fields))
        if isinstance(reply, _Hang):
            return await self._hang(receive)
        if reply[0] == 200 and body.get("stream") is True:  # the latency is then the time to the first chunk
            whole = reply[1]
            self.streamed += 1
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            reply = 200, _Streamed(json.loads(whole) if isinstance(whole, bytes) else whole, step.chunk_delay_s, usage)
        delay = start + self._latency(user, turn) - loop.time()
        if delay > 0 and not await self._wait_closing(delay):
            return reply
        if self._closing.is_set():
            return 503, _error_body(503, "the scripted server is shutting down", "ServiceUnavailable")
        return reply

    def _latency(self, user: str, turn: int) -> float:
        """This answer's simulated latency: latency_s, moved by up to latency_jitter_s by a hash of the rollout and
        turn (not Python's hash(), which differs between processes)."""
        jitter = self.script.latency_jitter_s
        if not jitter:
            return self.script.latency_s
        u = int.from_bytes(hashlib.blake2b(f"{user}#{turn}".encode(), digest_size=8).digest()) / 2.0**64
        return max(0.0, self.script.latency_s + (2 * u - 1) * jitter)

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
            await asyncio.gather(gone, closing, return_exceptions=True)
        if gone.done() and not gone.cancelled():
            return None
        return 503, _error_body(503, "the scripted server is shutting down", "ServiceUnavailable")

    def _fault(self, user: str, turn: int, step: Step) -> tuple[int, dict[str, Any]] | _Hang | None:
        """The scripted failure of this turn, if it still has one to give."""
        if not step.fault_applies(user):
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
        msg = step.error_message or f"scripted fault: HTTP {step.error_status} (turn {turn})"
        return step.error_status, _error_body(step.error_status, msg, "ScriptedFault")

    def _step(self, user: str, turn: int) -> Step:
        task = task_of(user)
        if task is not None and task in self.script.tasks:
            steps = self.script.tasks[task]
        elif self.script.default:
            steps = self.script.default
        else:
            return NO_SCRIPT_STEP
        return steps[turn] if turn < len(steps) else END_OF_SCRIPT_STEP

    def _toy_chat(self, body: dict[str, Any]) -> _Request:
        messages = _messages(body)
        for m in messages:  # its call arguments decoded, as vLLM does before it renders the conversation
            qwen.vllm_message(m)
        prompt = render_prompt(messages, self.script.template)
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        return turn, lambda step: self._completion(body, step, turn, prompt)

    def _qwen_chat(self, body: dict[str, Any], user: str) -> _Request:
        qwen.check_request(body, completions=False)
        messages = _messages(body)
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("'tools' must be a list of objects")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ValueError("'chat_template_kwargs' must be an object")
        prompt = self.model.chat_prompt(messages, tools, kwargs)
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        max_tokens = qwen.check_max_tokens(body, len(prompt), self.script.max_model_len, None)

        def answer(step: Step) -> dict[str, Any]:
            sample = self._sample(user, turn, prompt, step, max_tokens)
            return qwen.chat_response(self.model, body, sample, **self._meta(body))

        return turn, answer

    def _qwen_completions(self, body: dict[str, Any], user: str) -> _Request:
        qwen.check_request(body, completions=True)
        prompt = self.model.check_prompt_ids(body.get("prompt"))
        turn = self.model.turn_of(prompt)
        default = qwen.COMPLETIONS_DEFAULT_MAX_TOKENS
        max_tokens = qwen.check_max_tokens(body, len(prompt), self.script.max_model_len, default)

        def answer(step: Step) -> dict[str, Any]:
            sample = self._sample(user, turn, prompt, step, max_tokens)
            return qwen.completion_response(self.model, body, sample, **self._meta(body))

        return turn, answer

    def _sample(self, user: str, turn: int, prompt: list[int], step: Step, max_tokens: int | None) -> Sample:
        ids, logprobs, cut = self.model.sample(user, turn, step, max_tokens, prompt)
        finish = "length" if cut else (step.finish_reason or "stop")
        sample = Sample(user, turn, prompt, ids, logprobs, finish)
        self.samples.append(sample)
        return sample

    def _meta(self, body: dict[str, Any]) -> dict[str, Any]:
        served = body.get("model") if isinstance(body.get("model"), str) else self.script.model
        return {"tokens": self.tokens, "served": served, "response_id": str(next(self._ids))}

    def _answer(self, step: Step, turn: int) -> _Answer:
        # keyed by what the answer is made of: tasks of one script mostly share their steps' text and tool calls
        calls = tuple((tc.name, json.dumps(tc.arguments)) for tc in step.tool_calls)
        key = (turn, step.content, step.finish_reason, calls)
        answer = self._answers.get(key)
        if answer is None:
            tool_calls = [
                {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
                for i, (name, arguments) in enumerate(calls)
            ]
            message: dict[str, Any] = {
                "role": "assistant",
                "content": step.content if step.content or not tool_calls else None,
                "tool_calls": tool_calls,
            }
            finish = step.finish_reason or ("tool_calls" if tool_calls else "stop")
            answer = _Answer(message, toy.completion_ids(message), finish)
            if len(self._answers) >= MAX_CACHED_ANSWERS:
                self._answers.clear()
            self._answers[key] = answer
        return answer

    def _completion(self, body: dict[str, Any], step: Step, turn: int, prompt: list[int]) -> dict[str, Any]:
        answer = self._answer(step, turn)  # shared between responses: read, never changed
        completion = answer.completion
        choice: dict[str, Any] = {
            "index": 0,
            "message": answer.message,
            "logprobs": None,
            "finish_reason": answer.finish_reason,
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
            choice["logprobs"] = {"content": answer.logprob_entries(body.get("return_tokens_as_token_ids") is True)}
        return response


def _with_choice_fields(response: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any] | bytes:
    """The answer with a hostile step's fields in choices[0], encoded by the json module: orjson would write a NaN
    as null and refuse an int past 64 bits, which a hostile server sends as they are."""
    if not fields:
        return response
    choices = [{**response["choices"][0], **fields}, *response["choices"][1:]]  # the cached answer stays as it was
    return json.dumps({**response, "choices": choices}).encode()


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError("'messages' must be a non-empty list of objects")
    return messages


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
