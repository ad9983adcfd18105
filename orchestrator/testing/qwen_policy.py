"""The scripted policy's `qwen3` mode: a model server double that tokenizes, templates and parses like vLLM serving
Qwen3, so the token drift of real models shows up in tests.

It uses the offline Qwen-like tokenizer (qwen_like/) through transformers, imported when the mode is first used (the
toy mode never imports it). A scripted Step is "sampled" as token ids:

    <think>\\n{reasoning}\\n</think>\\n\\n{content}
    <tool_call>\\n{"name":"python",  "arguments": {...}}\\n</tool_call><|im_end|>

with the tool call's JSON spaced unlike json.dumps (the template re-serializes the parsed call), and some words split
into smaller pieces than the tokenizer would merge them into (a sampled tokenization is not always the canonical
one; decoding and re-encoding gives other ids). Ids, logprobs and the reasoning are deterministic per (rollout id,
turn). The chat route renders the prompt as vLLM does (apply_chat_template with the tools and the generation prompt,
tool call arguments parsed to objects first) and parses the answer back as vLLM's `qwen3` reasoning parser and
`hermes` tool parser do.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.core.errors import InvalidRequestError
from orchestrator.testing.policy_script import ScriptedToolCall, Step
from orchestrator.testing.qwen_like import IM_END, IM_START, MARKER_TOKENS, QWEN_LIKE_DIR, REASONING, SPECIAL_TOKENS

# vLLM's default max_tokens for /v1/completions (the chat route's default is the rest of the context)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# one sampled piece in this many is split into two smaller pieces (a non-canonical tokenization)
SPLIT_EVERY = 5
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(?!.*</tool_call>)(.*)", re.DOTALL)
_ASSISTANT_TURN = f"{IM_START}assistant"
# what DeepSeek-R1's and Qwen3-Thinking-2507's templates end the generation prompt with: the turn starts thinking
OPEN_THINKING = "<think>\n"


class RequestError(InvalidRequestError):
    """A request the model server refuses with HTTP 400; the message says what to fix."""


@dataclass(frozen=True)
class Sample:
    """One completion the double sampled: whose (rollout id), which turn, the prompt it saw, the ids and logprobs."""

    user: str
    turn: int
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class Parsed:
    """An answer as vLLM's reasoning and tool parsers split it: reasoning, content before the calls, the calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]


def _digest(*parts: object) -> int:
    # hashlib, not hash(): the same rollout id and turn give the same sample in every process
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:8], "big")


def logprob(user: str, turn: int, position: int, token_id: int) -> float:
    """A deterministic stand-in log-probability in [-5, 0) for a sampled token."""
    return -((_digest(user, turn, position, token_id) % 400) + 1) / 80


def tool_call_text(call: ScriptedToolCall) -> str:
    """A tool call as the double writes it: hermes JSON, spaced unlike json.dumps (and unlike the template)."""
    return (
        f'<tool_call>\n{{"name":{json.dumps(call.name)},  "arguments": '
        f"{json.dumps(call.arguments, ensure_ascii=False)}}}\n</tool_call>"
    )


class QwenLikeModel:
    """The Qwen-like tokenizer and template, sampling scripted Steps as ids and parsing answers like vLLM."""

    def __init__(self, path: Path = QWEN_LIKE_DIR) -> None:
        try:
            from transformers import AutoTokenizer  # the `tito` extra; only this mode needs it
        except ImportError as e:
            raise RuntimeError(f"the qwen3 template needs the tito extra (pip install 'envfleet[tito]'): {e}") from e

        self.tokenizer: Any = AutoTokenizer.from_pretrained(path)
        self.vocab_size = len(self.tokenizer)
        self._vocab: dict[str, int] = self.tokenizer.get_vocab()  # added tokens included
        self.eos_id = self._vocab[IM_END]
        self._added = {self._vocab[t] for t in (*SPECIAL_TOKENS, *MARKER_TOKENS)}

    # --- prompts -----------------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Text to ids, special tokens recognized, nothing added (as vLLM encodes a rendered prompt)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Ids to text."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> list[int]:
        """The prompt ids of a chat request, rendered as vLLM renders it."""
        try:
            text = self.tokenizer.apply_chat_template(
                [vllm_message(m) for m in messages],
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
        except RequestError:
            raise
        except Exception as e:  # jinja2's errors (a message the template cannot render) are the client's to fix
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None
        return self.encode(str(text))

    def check_prompt_ids(self, prompt: Any) -> list[int]:
        """A /v1/completions prompt (token ids or a string) as ids; RequestError when it is neither."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("'prompt' is empty")
            return self.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("'prompt' must be a non-empty list of token ids or a string (one prompt, not a batch)")
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise RequestError(f"prompt[{i}] = {t!r} is not a token id in [0, {self.vocab_size})")
        return list(prompt)

    def turn_of(self, prompt_ids: list[int]) -> int:
        """The assistant turns already in a prompt: `<|im_start|>assistant` blocks closed by `<|im_end|>`.

        Read from the prompt itself, not counted per client, so a retried request is the same turn again."""
        blocks = self.decode(prompt_ids).split(_ASSISTANT_TURN)[1:]
        return sum(1 for b in blocks if IM_END in b)

    # --- sampling ----------------------------------------------------------------------------------------------------

    def answer_text(self, user: str, turn: int, step: Step, *, opened: bool = False) -> str:
        """The text the double writes for a scripted Step (<|im_end|> included); `opened`: the prompt ended with the
        `<think>\n` that opens it (DeepSeek-R1's, Qwen3-Thinking-2507's templates), so the text starts inside it."""
        reasoning = REASONING[_digest("reasoning", user, turn) % len(REASONING)]
        text = f"{'' if opened else OPEN_THINKING}{reasoning}\n</think>\n\n{step.content}"
        for i, call in enumerate(step.tool_calls):
            text += ("\n" if step.content or i else "") + tool_call_text(call)
        return text + IM_END

    def sample(
        self, user: str, turn: int, step: Step, max_tokens: int | None, prompt: list[int] | None = None
    ) -> tuple[list[int], list[float], bool]:
        """The sampled ids and logprobs of a Step after prompt, cut at max_tokens; the flag says whether it was cut."""
        opened = prompt is not None and self.decode(prompt[-4:]).endswith(OPEN_THINKING)
        ids: list[int] = []
        for i, t in enumerate(self.encode(self.answer_text(user, turn, step, opened=opened))):
            ids += self._pieces(t) if _digest("split", user, turn, i) % SPLIT_EVERY == 0 else [t]
        cut = max_tokens is not None and len(ids) > max_tokens
        if cut:
            ids = ids[:max_tokens]
        return ids, [logprob(user, turn, i, t) for i, t in enumerate(ids)], cut

    def _pieces(self, token_id: int) -> list[int]:
        """token_id as two smaller vocabulary pieces with the same bytes, when it has such a split."""
        if token_id in self._added:
            return [token_id]
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        for k in range(len(piece) - 1, 0, -1):
            head, tail = self._vocab.get(piece[:k]), self._vocab.get(piece[k:])
            if head is not None and tail is not None:
                return [head, tail]
        return [token_id]

    def token_text(self, token_id: int) -> str:
        """One token as vLLM's logprobs show it: its text."""
        return self.decode([token_id])

    # --- parsing -----------------------------------------------------------------------------------------------------

    def parse(self, ids: list[int], turn: int) -> Parsed:
        """An answer split as vLLM's `qwen3` reasoning parser and `hermes` tool parser do (specials skipped)."""
        text = self.decode(ids, skip_special_tokens=True)
        reasoning: str | None = None
        if "</think>" in text:
            head, _, text = text.partition("</think>")
            reasoning = head.split("<think>", 1)[-1]
        calls: list[dict[str, Any]] = []
        for i, m in enumerate(_TOOL_CALL.finditer(text)):
            try:
                obj = json.loads((m.group(1) if m.group(1) is not None else m.group(2)).strip())
                name, args = obj["name"], obj.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError("name is not a string")
            except (ValueError, KeyError, TypeError, AttributeError):
                calls = []  # as hermes: one unparsable call and the whole answer is content
                break
            fn = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
            calls.append({"id": f"call_{turn}_{i}", "type": "function", "function": fn})
        content = text[: text.find("<tool_call>")] if calls else text
        return Parsed(reasoning, content or None, calls)


def vllm_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A chat message as vLLM hands it to the template: tool call arguments parsed from JSON text to objects."""
    calls = msg.get("tool_calls")
    if not calls:
        return msg
    if not isinstance(calls, list):
        raise RequestError("a message's 'tool_calls' must be a list")
    out = []
    for i, tc in enumerate(calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tool_calls[{i}] must be an object with a 'function' that has a 'name'")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError as e:
                raise RequestError(f"tool_calls[{i}].function.arguments is not JSON: {e}") from None
        out.append({**tc, "function": {**fn, "arguments": args}})
    return {**msg, "tool_calls": out}


def check_max_tokens(
    body: dict[str, Any], prompt_len: int, max_model_len: int | None, default: int | None
) -> int | None:
    """max_tokens of a request, checked against the context as vLLM checks it (RequestError when over)."""
    raw = body.get("max_completion_tokens", body.get("max_tokens"))
    if raw is None:
        max_tokens = default
    elif isinstance(raw, int) and not isinstance(raw, bool) and raw >= 1:
        max_tokens = raw
    else:
        raise RequestError(f"'max_tokens' must be a positive integer, not {raw!r}")
    if max_model_len is None:
        return max_tokens
    if prompt_len >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has {prompt_len} "
            "input tokens. Please reduce the length of the input messages."
        )
    room = max_model_len - prompt_len
    if raw is None:  # a default is capped by the context; an explicit request over it is refused
        return room if max_tokens is None else min(max_tokens, room)
    assert max_tokens is not None
    if max_tokens > room:
        raise RequestError(
            f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is {max_model_len} "
            f"tokens and your request has {prompt_len} input tokens ({max_tokens} > {max_model_len} - {prompt_len})."
        )
    return max_tokens


def _usage(prompt: list[int], ids: list[int]) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}


def _token_label(model: QwenLikeModel, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else model.token_text(token_id)


def chat_response(
    model: QwenLikeModel, body: dict[str, Any], sample: Sample, *, tokens: bool, served: str, response_id: str
) -> dict[str, Any]:
    """A vLLM-style chat completion of a sample: the parsed message, token ids and logprobs when asked for."""
    parsed = model.parse(sample.ids, sample.turn)
    message = {
        "role": "assistant",
        "content": parsed.content,
        "reasoning_content": parsed.reasoning,
        "tool_calls": parsed.tool_calls,
    }
    finish = sample.finish_reason
    if finish == "stop" and parsed.tool_calls:
        finish = "tool_calls"
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    response: dict[str, Any] = {
        "id": f"chatcmpl-{response_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served,
        "choices": [choice],
        "usage": _usage(sample.prompt_ids, sample.ids),
    }
    if tokens and body.get("return_token_ids") is True:
        response["prompt_token_ids"] = sample.prompt_ids
        choice["token_ids"] = sample.ids
    if tokens and body.get("logprobs") is True:
        as_ids = body.get("return_tokens_as_token_ids") is True
        choice["logprobs"] = {
            "content": [
                {
                    "token": _token_label(model, t, as_ids),
                    "logprob": lp,
                    "bytes": list(model.token_text(t).encode()),
                    "top_logprobs": [],
                }
                for t, lp in zip(sample.ids, sample.logprobs, strict=True)
            ]
        }
    return response


def completion_response(
    model: QwenLikeModel, body: dict[str, Any], sample: Sample, *, tokens: bool, served: str, response_id: str
) -> dict[str, Any]:
    """A vLLM-style /v1/completions answer of a sample: the text, and in the choice the token ids and logprobs."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": model.decode(sample.ids, skip_special_tokens=True),
        "logprobs": None,
        "finish_reason": sample.finish_reason,
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    if tokens and body.get("return_token_ids") is True:
        choice["prompt_token_ids"] = sample.prompt_ids
        choice["token_ids"] = sample.ids
    if tokens and body.get("logprobs") is not None:
        as_ids = body.get("return_tokens_as_token_ids") is True
        labels = [_token_label(model, t, as_ids) for t in sample.ids]
        offsets, at = [], 0
        for t in sample.ids:
            offsets.append(at)
            at += len(model.token_text(t))
        choice["logprobs"] = {
            "text_offset": offsets,
            "token_logprobs": sample.logprobs,
            "tokens": labels,
            "top_logprobs": [{label: lp} for label, lp in zip(labels, sample.logprobs, strict=True)],
        }
    return {
        "id": f"cmpl-{response_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served,
        "choices": [choice],
        "usage": _usage(sample.prompt_ids, sample.ids),
    }


def check_request(body: dict[str, Any], *, completions: bool) -> None:
    """Refuse what the double does not do (several choices, echo) instead of answering something else; a stream is
    the app's (policy_app.stream_chunks)."""
    if body.get("n") not in (None, 1):
        raise RequestError(f"'n' must be 1, not {body.get('n')!r}")
    if completions:
        if body.get("echo") is True:
            raise RequestError("'echo': true is not supported by the scripted policy")
        lp = body.get("logprobs")
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= 20):
            raise RequestError(f"'logprobs' of /v1/completions is the number of top logprobs (0 to 20), not {lp!r}")
