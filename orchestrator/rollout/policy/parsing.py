"""Parsing an OpenAI-compatible chat completion (with vLLM/SGLang token ids and logprobs) into a Completion."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.core.errors import PolicyResponseError
from orchestrator.rollout.policy import token_checks as checks
from orchestrator.rollout.policy.base import Completion, ToolCall

# A policy URL may point anywhere a tenant chose: error messages describe a response (its type, its keys, its size)
# but never quote it, so an error cannot be used to read another host's answers.

_CONTENT = "choices[0].logprobs.content"


def _logprob_entries(choice: dict[str, Any]) -> list[dict[str, Any]] | None:
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if isinstance(content, list) and all(isinstance(e, dict) for e in content):
        return content
    return None


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
    """A Completion from a chat completions response body; raises PolicyResponseError when it is not one, and
    PolicyTokenError when its token ids or logprobs are not exact values a rollout can carry (token_checks.py).
    Token fields the server left out stay None: the rollout's tokens are then "missing", never invented."""
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

    prompt_ids = checks.token_ids(data.get("prompt_token_ids"), "prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = checks.token_ids(choice.get("prompt_token_ids"), "choices[0].prompt_token_ids")
    entries = _logprob_entries(choice)
    ids_at = "choices[0].token_ids"
    completion_ids = checks.token_ids(choice.get("token_ids"), ids_at)
    if completion_ids is None and entries is not None:
        ids_at = _CONTENT + "[].token"
        completion_ids = checks.ids_from_labels([e.get("token") for e in entries], _CONTENT + "[{i}].token")
    logprobs = None
    if entries is not None:
        logprobs = checks.logprobs([e.get("logprob") for e in entries], _CONTENT + "[{i}].logprob")
    if completion_ids is not None and logprobs is not None:
        checks.same_length(completion_ids, logprobs, ids_at, _CONTENT)

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
