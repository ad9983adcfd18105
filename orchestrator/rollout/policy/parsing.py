"""Parsing an OpenAI-compatible chat completion (with vLLM/SGLang token ids and logprobs) into a Completion."""

from __future__ import annotations

import json
import logging
from typing import Any

from orchestrator.core.errors import PolicyResponseError
from orchestrator.rollout.policy.base import Completion, ToolCall

log = logging.getLogger(__name__)

# A policy URL may point anywhere a tenant chose: error messages describe a response (its type, its keys, its size)
# but never quote it, so an error cannot be used to read another host's answers.
TOKEN_ID_PREFIX = "token_id:"


_INT = frozenset({int})


def _int_list(value: Any) -> list[int] | None:
    # every item an int, not a bool (nor a float): decoded JSON has no other int subclass; types compared in C
    if isinstance(value, list) and set(map(type, value)) <= _INT:
        return list(value)
    return None


def _logprob_entries(choice: dict[str, Any]) -> list[dict[str, Any]] | None:
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if isinstance(content, list) and all(isinstance(e, dict) for e in content):
        return content
    return None


def _logprobs(entries: list[dict[str, Any]]) -> list[float] | None:
    out: list[float] = []
    for e in entries:
        v = e.get("logprob")
        if not isinstance(v, int | float) or isinstance(v, bool):
            return None
        out.append(float(v))
    return out


def _ids_from_logprob_tokens(entries: list[dict[str, Any]]) -> list[int] | None:
    # With return_tokens_as_token_ids, vLLM writes each sampled token as "token_id:N".
    out: list[int] = []
    for e in entries:
        tok = e.get("token")
        if not isinstance(tok, str) or not tok.startswith(TOKEN_ID_PREFIX):
            return None
        try:
            out.append(int(tok[len(TOKEN_ID_PREFIX) :]))
        except ValueError:
            return None
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise PolicyResponseError(f"message content is a {type(content).__name__}, expected a string")


def _tool_calls(raw: Any) -> tuple[list[ToolCall], list[dict[str, Any]]]:
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise PolicyResponseError(f"message tool_calls is a {type(raw).__name__}, expected a list")
    calls: list[ToolCall] = []
    wire: list[dict[str, Any]] = []
    for i, tc in enumerate(raw):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise PolicyResponseError(f"tool call {i} has no function name")
        args = fn.get("arguments", "")
        if not isinstance(args, str):  # some servers send the parsed object; keep it as the JSON text it was
            args = json.dumps(args)
        call_id = tc.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = f"call_{i}"  # the tool result must name a call; the id is the server's, not the model's
        calls.append(ToolCall(call_id, fn["name"], args))
        wire.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return calls, wire


def parse_chat_completion(data: Any, *, model: str) -> Completion:
    """A Completion from a chat completions response body; raises PolicyResponseError when it is not one."""
    if not isinstance(data, dict):
        raise PolicyResponseError(f"response is a {type(data).__name__}, expected a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PolicyResponseError(f"response has no choices (a JSON object of {len(data)} keys)")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise PolicyResponseError("choices[0] has no message object")
    content = message.get("content")
    text = _text(content)
    tool_calls, wire_calls = _tool_calls(message.get("tool_calls"))

    prompt_ids = _int_list(data.get("prompt_token_ids"))
    if prompt_ids is None:
        prompt_ids = _int_list(choice.get("prompt_token_ids"))
    entries = _logprob_entries(choice)
    completion_ids = _int_list(choice.get("token_ids"))
    if completion_ids is None and entries is not None:
        completion_ids = _ids_from_logprob_tokens(entries)
    logprobs = _logprobs(entries) if entries is not None else None
    if completion_ids is not None and logprobs is not None and len(completion_ids) != len(logprobs):
        log.warning(
            "policy returned %d completion ids but %d logprobs; dropping the logprobs",
            len(completion_ids),
            len(logprobs),
        )
        logprobs = None

    raw_message: dict[str, Any] = {"role": "assistant", "content": content if isinstance(content, str) else text}
    if content is None:
        raw_message["content"] = None if wire_calls else ""
    if wire_calls:
        raw_message["tool_calls"] = wire_calls
    finish_reason = choice.get("finish_reason")
    served_model = data.get("model")
    return Completion(
        text=text,
        tool_calls=tool_calls,
        finish_reason=finish_reason if isinstance(finish_reason, str) else "unknown",
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        logprobs=logprobs,
        model=served_model if isinstance(served_model, str) and served_model else model,
        raw_message=raw_message,
    )
