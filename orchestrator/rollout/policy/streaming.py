"""A streamed answer (`"stream": true`, server-sent events) put back together as the answer the server would have
sent whole, so one parser (parsing.py, tito/policy.py) reads both and checks the same token fields.

Why stream: a whole answer comes at the end of its generation, so the request's timeout had to cover the longest
generation, and a long one (a reasoning model's 30,000 tokens) ran past it and ended POLICY_ERROR, masked from
training, while a dead server took the whole timeout to show. Streamed, the timeout is the longest silence between
two pieces of the answer (http.py), and a generation may take as long as it keeps sending.

Each event is a chunk of the chat completion (`choices[0].delta`: content, tool call pieces by index) or of the
completion (`choices[0].text`), with the token fields vLLM and SGLang add per chunk: `token_ids` and `logprobs` of
the chunk's tokens, `prompt_token_ids` once. They are concatenated in order, field by field; the parser then checks
them as it checks a whole answer (ids and logprobs of one length, exact values). A stream that ends before
`data: [DONE]`, or that carries an error event, is an unfinished generation (GenerationAborted, retried as a 5xx):
a cut answer is never a turn. The server is untrusted: a chunk of the wrong shape is a PolicyResponseError that names
the chunk and the field, never quotes it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from orchestrator.core.errors import GenerationAborted, PolicyResponseError

DONE = b"[DONE]"
EVENT_STREAM = "text/event-stream"


def _events(body: bytes) -> list[bytes]:
    """The data of each server-sent event, up to `[DONE]`; GenerationAborted when the stream ended before it."""
    events: list[bytes] = []
    data: list[bytes] = []
    for raw in body.split(b"\n"):
        line = raw[:-1] if raw.endswith(b"\r") else raw
        if not line:  # an event ends at a blank line
            if data:
                event = b"\n".join(data)
                if event.strip() == DONE:
                    return events
                events.append(event)
                data = []
            continue
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        # comments (":...") and the other fields (event, id, retry) carry nothing an answer needs
    if data and b"\n".join(data).strip() == DONE:  # [DONE] as the last line, without its blank line
        return events
    raise GenerationAborted("the policy server's stream ended before `data: [DONE]`: the generation is incomplete")


def _decode(event: bytes, n: int) -> dict[str, Any]:
    try:
        chunk = orjson.loads(event)
    except orjson.JSONDecodeError:
        try:
            chunk = json.loads(event)  # NaN and the like, as a whole answer is read (client._loads)
        except ValueError:
            raise PolicyResponseError(f"stream event {n} is not JSON ({len(event)} bytes)") from None
    if not isinstance(chunk, dict):
        raise PolicyResponseError(f"stream event {n} is a {type(chunk).__name__}, expected a JSON object")
    if chunk.get("error") is not None:  # vLLM and SGLang end a failed generation with an error event
        raise GenerationAborted(f"the policy server's stream reported an error at event {n}: the generation failed")
    return chunk


def _expect(value: Any, kind: type, where: str) -> Any:
    if not isinstance(value, kind):
        raise PolicyResponseError(f"{where} is a {type(value).__name__}, expected a {kind.__name__}")
    return value


class _Choice:
    """choices[0] of a whole answer, built from the chunks' pieces."""

    def __init__(self) -> None:
        self.chat = False
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.lists: dict[str, list[Any]] = {}  # logprobs.content (chat), logprobs.<field> (completions)
        self.token_ids: list[Any] | None = None
        self.prompt_ids: Any = None
        self.finish: Any = None

    def add(self, choice: dict[str, Any], where: str) -> None:
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        if choice.get("prompt_token_ids") is not None:
            self.prompt_ids = choice["prompt_token_ids"]
        ids = choice.get("token_ids")
        if ids is not None:
            self.token_ids = [*(self.token_ids or []), *_expect(ids, list, f"{where}.token_ids")]
        lp = choice.get("logprobs")
        if lp is not None:
            for key, value in _expect(lp, dict, f"{where}.logprobs").items():
                if isinstance(value, list):
                    self.lists.setdefault(key, []).extend(value)
        delta = choice.get("delta")
        if delta is None:
            text = choice.get("text")
            if text is not None:
                self.text.append(_expect(text, str, f"{where}.text"))
            return
        self.chat = True
        delta = _expect(delta, dict, f"{where}.delta")
        if delta.get("content") is not None:
            self.text.append(_expect(delta["content"], str, f"{where}.delta.content"))
        for i, piece in enumerate(_expect(delta.get("tool_calls") or [], list, f"{where}.delta.tool_calls")):
            self._call_piece(_expect(piece, dict, f"{where}.delta.tool_calls[{i}]"), f"{where}.delta.tool_calls[{i}]")

    def _call_piece(self, piece: dict[str, Any], where: str) -> None:
        index = piece.get("index", len(self.calls))
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1024:
            raise PolicyResponseError(f"{where}.index is not a tool call index (0..1023)")
        call = self.calls.setdefault(index, {"type": "function", "function": {"name": "", "arguments": ""}})
        if piece.get("id") is not None:
            call["id"] = _expect(piece["id"], str, f"{where}.id")
        fn = _expect(piece.get("function") or {}, dict, f"{where}.function")
        for key in ("name", "arguments"):
            if fn.get(key) is not None:
                call["function"][key] += _expect(fn[key], str, f"{where}.function.{key}")

    def whole(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": 0, "finish_reason": self.finish}
        if self.chat:
            calls = [self.calls[i] for i in sorted(self.calls)]
            content = "".join(self.text)
            message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
            if "content" in self.lists:
                out["logprobs"] = {"content": self.lists["content"]}
        else:
            out["text"] = "".join(self.text)
            if self.lists:
                out["logprobs"] = dict(self.lists)
        if self.token_ids is not None:
            out["token_ids"] = self.token_ids
        if self.prompt_ids is not None:
            out["prompt_token_ids"] = self.prompt_ids
        return out


def collect(body: bytes) -> dict[str, Any]:
    """The whole answer a streamed one adds up to (the first choice only: one is asked for)."""
    choice = _Choice()
    whole: dict[str, Any] = {}
    for n, event in enumerate(_events(body)):
        chunk = _decode(event, n)
        if isinstance(chunk.get("model"), str):
            whole["model"] = chunk["model"]
        if chunk.get("prompt_token_ids") is not None:  # vLLM: at the top level, on the first chunk
            whole["prompt_token_ids"] = chunk["prompt_token_ids"]
        for i, c in enumerate(_expect(chunk.get("choices") or [], list, f"stream event {n}'s choices")):
            where = f"stream event {n}'s choices[{i}]"
            c = _expect(c, dict, where)
            if c.get("index", 0) == 0:
                choice.add(c, where)
    whole["choices"] = [choice.whole()]
    return whole
