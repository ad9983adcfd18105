"""A streamed answer (`"stream": true`, server-sent events) put back together as the answer the server would have
sent whole, so one parser (parsing.py, tito/policy.py) reads both and checks the same token fields.

Why stream: a whole answer comes at the end of its generation, so the request's timeout had to cover the longest
generation, and a long one (a reasoning model's 30,000 tokens) ran past it and ended POLICY_ERROR, masked from
training, while a dead server took the whole timeout to show. Streamed, the timeout is the longest silence between
two pieces of the answer (http.py), and a generation may take as long as it keeps sending.

Each event is a chunk of the chat completion (`choices[0].delta`: content, tool call pieces by index) or of the
completion (`choices[0].text`), with the token fields vLLM and SGLang add per chunk: `token_ids` and `logprobs` of
the chunk's tokens, `prompt_token_ids` once. They are concatenated in order, field by field; the parser then checks
them as it checks a whole answer (ids and logprobs of one length, exact values); here each chunk's ids and
logprobs must line up too, and all the ids must be as many as the stream's `usage` says were sampled (a chat stream
without `usage` keeps none: its tokens are missing). A stream that ends before `data: [DONE]` or without a
finish_reason, or that carries an error event, is an unfinished generation (GenerationAborted, retried as a 5xx): a
cut answer is never a turn; an error that says the context is full is ContextFull, as the 400 is. The server is
untrusted: a chunk of the wrong shape is a PolicyResponseError that names the chunk and the field, never quotes it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from orchestrator.core.errors import ContextFull, GenerationAborted, PolicyResponseError, PolicyTokenError
from orchestrator.core.log_limit import LogLimit
from orchestrator.core.text import texts
from orchestrator.rollout.policy.parsing import CONTEXT_FULL

DONE = b"[DONE]"
EVENT_STREAM = "text/event-stream"
BOM = b"\xef\xbb\xbf"
# a stream may start with a byte order mark, and end its lines with CRLF, LF or CR alone (the SSE standard)
_LINE_END = re.compile(rb"\r\n|\r|\n")
log = logging.getLogger(__name__)


def _events(lines: Iterable[bytes], *, cut: bool = False) -> Iterator[bytes]:
    """The data of each server-sent event, up to `[DONE]`; GenerationAborted when the stream ended before it. A
    stream `cut` short (at the response cap) gives its complete events, without the one it was cut in."""
    data: list[bytes] = []
    for line in lines:
        if not line:  # an event ends at a blank line
            if data:
                event = b"\n".join(data)
                if event.strip() == DONE:
                    return
                yield event
                data = []
            continue
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        # comments (":...") and the other fields (event, id, retry) carry nothing an answer needs
    if cut or (data and b"\n".join(data).strip() == DONE):  # [DONE] as the last line, without its blank line
        return
    raise GenerationAborted("the policy server's stream ended before `data: [DONE]`: the generation is incomplete")


def _lines(body: bytes) -> Iterator[bytes]:
    """The complete lines of a stream cut short, one at a time: its last, cut line is not one. (A whole stream's are
    split at once, which is quicker and holds them all.)"""
    start = 0
    for end in _LINE_END.finditer(body):
        yield body[start : end.start()]
        start = end.end()


def _decode(event: bytes, n: int) -> tuple[dict[str, Any], bool]:
    """The event's chunk, and whether the json module read it (orjson refused it): its strings may then hold
    surrogates, a pair's halves in two events or a lone one, which `collect` makes text once they are joined."""
    lax = False
    try:
        chunk = orjson.loads(event)
    except orjson.JSONDecodeError:
        lax = True
        try:
            chunk = json.loads(event)  # NaN and the like, as a whole answer is read (client._loads)
        except (ValueError, RecursionError):  # RecursionError: nested past the json module's depth
            raise PolicyResponseError(f"stream event {n} is not JSON ({len(event)} bytes)") from None
    if not isinstance(chunk, dict):
        raise PolicyResponseError(f"stream event {n} is a {type(chunk).__name__}, expected a JSON object")
    # vLLM and SGLang end a failed generation with an error event ({"error": {...}}, or vLLM's {"object": "error"})
    error = chunk.get("error")
    if error is not None or chunk.get("object") == "error":
        detail = error if isinstance(error, dict) else chunk
        message = detail.get("message")
        if isinstance(message, str) and CONTEXT_FULL.search(message[:4096]):
            # SGLang says so in the stream: the conversation outgrew the model, the episode's own end (client.py)
            raise ContextFull("the policy server's stream says the conversation is over the model's context")
        raise GenerationAborted(f"the policy server's stream reported an error at event {n}: the generation failed")
    return chunk, lax


def _expect(value: Any, kind: type, where: str) -> Any:
    if not isinstance(value, kind):
        raise PolicyResponseError(f"{where} is a {type(value).__name__}, expected a {kind.__name__}")
    return value


class _Choice:
    """choices[0] of a whole answer, built from the chunks' pieces (each kept in a list, joined once at the end)."""

    def __init__(self) -> None:
        self.chat = False
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # index -> id, name pieces, argument pieces
        self.lists: dict[str, list[Any]] = {}  # logprobs.content (chat), logprobs.<field> (completions)
        self.token_ids: list[Any] | None = None
        self.prompt_ids: Any = None
        self.finish: Any = None
        self.counts: list[tuple[int, int, int]] = []  # per chunk with tokens: (event, token ids, logprob entries)

    def add(self, choice: dict[str, Any], n: int, where: str) -> None:
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        if choice.get("prompt_token_ids") is not None:
            self.prompt_ids = choice["prompt_token_ids"]
        ids = choice.get("token_ids")
        if ids is not None:
            ids = _expect(ids, list, f"{where}.token_ids")
            self.token_ids = self.token_ids or []
            self.token_ids.extend(ids)
        entries = 0
        lp = choice.get("logprobs")
        if lp is not None:
            for key, value in _expect(lp, dict, f"{where}.logprobs").items():
                if value is None:
                    continue
                if key in ("content", "tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    value = _expect(value, list, f"{where}.logprobs.{key}")
                    entries = max(entries, len(value))
                if isinstance(value, list):
                    self.lists.setdefault(key, []).extend(value)
        if ids is not None or entries:
            self.counts.append((n, len(ids or ()), entries))
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
        # a piece without its index continues the call before it (servers send the index on every piece)
        index = piece.get("index", max(self.calls, default=0))
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1024:
            raise PolicyResponseError(f"{where}.index is not a tool call index (0..1023)")
        call = self.calls.setdefault(index, {"id": None, "name": [], "arguments": []})
        if piece.get("id") is not None:
            call["id"] = _expect(piece["id"], str, f"{where}.id")
        fn = _expect(piece.get("function") or {}, dict, f"{where}.function")
        for key in ("name", "arguments"):
            if fn.get(key) is not None:
                call[key].append(_expect(fn[key], str, f"{where}.function.{key}"))

    def whole(self) -> dict[str, Any]:
        if self.finish is None:
            # every server ends a stream's last chunk with one; without it the answer may be cut (a whole answer's
            # parser takes a missing finish_reason as finished, which a stream must not lend itself to)
            raise GenerationAborted("the policy server's stream ended without a finish_reason: it may be incomplete")
        if self.token_ids is not None and self.lists:
            for n, ids, entries in self.counts:
                if ids != entries:
                    raise PolicyTokenError(
                        f"stream event {n} carries {ids} token ids and {entries} logprobs: they do not line up"
                    )
        out: dict[str, Any] = {"index": 0, "finish_reason": self.finish}
        if self.chat:
            calls = []
            for i in sorted(self.calls):
                c = self.calls[i]
                fn = {"name": "".join(c["name"]), "arguments": "".join(c["arguments"])}
                calls.append({**({"id": c["id"]} if c["id"] is not None else {}), "type": "function", "function": fn})
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

    def carried(self) -> int | None:
        """How many sampled tokens the stream carried: its ids, else the logprob entries the parser reads them from
        (the `token_id:N` labels of a server that sends no ids); None when it carried none of either."""
        if self.token_ids is not None:
            return len(self.token_ids)
        for key in ("content", "tokens", "token_logprobs"):
            if key in self.lists:
                return len(self.lists[key])
        return None


def collect(body: bytes, said: LogLimit | None = None) -> dict[str, Any]:
    """The whole answer a streamed one adds up to (the first choice only: one is asked for). When the stream says
    how many tokens it sampled (`usage`, asked for with stream_options.include_usage), the token ids must be that
    many: a server whose tool or reasoning parser held a chunk back has sent neither its ids nor its logprobs, and
    the two lists would still be of one length. A chat stream that does not say is answered without its token ids
    and logprobs, so the rollout's tokens are "missing", never complete with a hole in them. `said` limits the
    warning that says so (a server that ignores include_usage does on every turn)."""
    choice, whole, sampled, lax = _read(body)
    out = choice.whole()
    whole["choices"] = [out]
    carried = choice.carried()
    if carried is not None and sampled is not None and sampled != carried:
        raise PolicyTokenError(
            f"the policy server's stream carried {carried} tokens but says it sampled {sampled} "
            "(usage.completion_tokens): some never arrived; use token_mode tito, or a server that sends every one"
        )
    if carried is not None and sampled is None and choice.chat:
        # A server that ignored include_usage skipped the only check of held-back chunks, and on an episode's last
        # turn no later prompt showed the gap: the rollout went to the trainer "complete" without those ids. The
        # completions endpoint (tito) runs no tool or reasoning parser, so nothing is held back there.
        out.pop("token_ids", None)
        out.pop("logprobs", None)
        if (more := "" if said is None else said.allow("no usage")) is not None:
            log.warning(
                "the policy server's stream did not say how many tokens it sampled (no usage: it ignores "
                "stream_options.include_usage), so ids its tool or reasoning parser held back would go unseen; this "
                "turn's %d token ids are dropped and the rollout's tokens are missing. Use a server that sends usage "
                "when streaming, token_mode tito, or stream: false%s",
                carried,
                more,
            )
    return texts(whole) if lax else whole


def cut_answer(body: bytes, tokens: int) -> dict[str, Any]:
    """The answer the complete events of a stream cut at its cap add up to, read until they carry more than `tokens`
    sampled tokens (or to the cut), as `length` where they give no finish_reason: for the parser to check as it
    checks any answer. PolicyError when an event is not a chunk."""
    choice, whole, _, lax = _read(body, cut=True, tokens=tokens)
    if choice.finish is None:
        choice.finish = "length"
    whole["choices"] = [choice.whole()]
    return texts(whole) if lax else whole


def _read(body: bytes, *, cut: bool = False, tokens: int | None = None) -> tuple[_Choice, dict[str, Any], Any, bool]:
    """The stream's first choice (read until it carries more than `tokens`, when given), the answer's other fields,
    the sampled count its `usage` gives, and whether the json module read an event (its strings to be made text)."""
    choice = _Choice()
    whole: dict[str, Any] = {}
    sampled: Any = None
    lax = False
    body = body.removeprefix(BOM)
    events = _events(_lines(body), cut=True) if cut else list(_events(body.splitlines()))
    for n, event in enumerate(events):
        if tokens is not None and (choice.carried() or 0) > tokens:
            break
        chunk, lax_event = _decode(event, n)
        lax |= lax_event
        if isinstance(chunk.get("model"), str):
            whole["model"] = chunk["model"]
        if chunk.get("prompt_token_ids") is not None:  # vLLM: at the top level, on the first chunk
            whole["prompt_token_ids"] = chunk["prompt_token_ids"]
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            sampled = usage["completion_tokens"]
        for i, c in enumerate(_expect(chunk.get("choices") or [], list, f"stream event {n}'s choices")):
            where = f"stream event {n}'s choices[{i}]"
            c = _expect(c, dict, where)
            if c.get("index", 0) == 0:
                choice.add(c, n, where)
    return choice, whole, sampled, lax
