"""Parsing an OpenAI-compatible chat completion (with vLLM/SGLang token ids and logprobs) into a Completion."""

from __future__ import annotations

import json
import re
from typing import Any

from orchestrator.core.errors import GenerationAborted, PolicyResponseError, PolicyTokenError
from orchestrator.core.text import as_text
from orchestrator.rollout.policy import token_checks as checks
from orchestrator.rollout.policy.base import Completion, ToolCall

# A policy URL may point anywhere a tenant chose: error messages describe a response (its type, its keys, its size)
# but never quote it, so an error cannot be used to read another host's answers.

_CONTENT = "choices[0].logprobs.content"

# What a turn's finish_reason says, by value. A turn is only taken when the server says it ended it: at a stop
# (OpenAI's names; TGI's eos_token and stop_sequence) or cut short (max_tokens, a content filter). A generation the
# server gave up on (vLLM and SGLang answer a request aborted by a weight sync with HTTP 200, the partial output and
# "abort"; "error" for one that failed) is never a turn, and neither is a value this client does not know: either may
# be a cut answer, and scoring it would pass a server's failure off as the model's reward.
FINISHED = frozenset({"stop", "tool_calls", "function_call", "eos_token", "stop_sequence"})
CUT_OFF = frozenset({"length", "content_filter"})
NOT_FINISHED = frozenset({"abort", "error"})
NOT_SAID = "unknown"  # no finish_reason (null or absent): taken as finished, as servers that omit it always were
_NAME = re.compile(r"[A-Za-z0-9_.-]{0,40}")
MAX_MODEL_CHARS = 256  # what a response's "model" keeps
# How servers say a request is over the model's context: vLLM ("This model's maximum context length is ...", "... is
# longer than the maximum model length of ..."), SGLang ("... longer than the model's context length"), OpenAI's own
# wording; read in a 400's body (client.py) and in a stream's error event (streaming.py).
CONTEXT_FULL = re.compile(r"maximum context length|context length|maximum model length|max_model_len", re.IGNORECASE)


def finish_reason(value: Any, where: str) -> str:
    """A turn's finish_reason (`where` names the field): one of FINISHED or CUT_OFF, or NOT_SAID for null. A value of
    NOT_FINISHED raises GenerationAborted; any other value, PolicyResponseError naming it (quoted only when it looks
    like a name, so a server cannot make the error carry its data)."""
    if value is None:
        return NOT_SAID
    if not isinstance(value, str):
        raise PolicyResponseError(f"{where} is a {type(value).__name__}, expected a string")
    if value in FINISHED or value in CUT_OFF:
        return value
    if value in NOT_FINISHED:
        said = f"the policy server did not finish the generation (finish_reason {value!r})"
        raise GenerationAborted(said, down=value == "abort")
    shown = repr(value) if _NAME.fullmatch(value) else f"a string of {len(value)} characters"
    raise PolicyResponseError(
        f"{where} is {shown}, which this client does not know: it takes a turn that ended with one of "
        f"{', '.join(sorted(FINISHED | CUT_OFF))} (or none said), and this one may be incomplete"
    )


def _logprob_entries(choice: dict[str, Any]) -> list[dict[str, Any]] | None:
    """logprobs.content, or None when the answer has none; a value of another shape is no logprobs at all, so it is
    refused (PolicyTokenError), never read as none."""
    lp = choice.get("logprobs")
    if lp is None:
        return None
    if not isinstance(lp, dict):
        raise PolicyTokenError(f"choices[0].logprobs is a {type(lp).__name__}, expected an object")
    content = lp.get("content")
    if content is None:
        return None
    if not isinstance(content, list) or not all(isinstance(e, dict) for e in content):
        raise PolicyTokenError(f"{_CONTENT} is not a list of objects (one per sampled token)")
    return content


def served_model(value: Any, asked: str) -> str:
    """The model a response says served it (`asked` when it names none), cut to MAX_MODEL_CHARS and made text: it is
    the rollout's provenance, which no episode budget counts (a "model" of 17 MiB made a rollout no worker could
    send, retried as INFRA_ERROR)."""
    if not isinstance(value, str) or not value:
        return asked
    return as_text(value[:MAX_MODEL_CHARS])


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if not all(isinstance(p.get("text", ""), str) for p in parts):
            raise PolicyResponseError("a text part of the message content has a text that is no string")
        return "".join(p.get("text", "") for p in parts)
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
            try:
                args = json.dumps(args)
            except RecursionError:  # nested past the json module's depth: no call a rollout can record
                raise PolicyResponseError(f"tool call {i}'s arguments are nested too deeply to be JSON") from None
        call_id = tc.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = f"call_{i}"  # the tool result must name a call; the id is the server's, not the model's
        calls.append(ToolCall(call_id, fn["name"], args))
        wire.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": _echoed(args)}})
    return calls, wire


def _echoed(args: str) -> str:
    """A call's arguments as the next request sends them back: a JSON object as it was written, anything else as
    "{}". Servers decode them to render the conversation (vLLM json.loads each one), and answered the next request
    400 for text that is no JSON object: the episode ended POLICY_ERROR, masked, so a malformed call escaped the 0 it
    earned. The call itself runs with what the model wrote, and the tool's answer tells it what was wrong."""
    try:
        parsed = json.loads(args)
    except (ValueError, RecursionError):
        return "{}"
    return args if isinstance(parsed, dict) else "{}"


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
    finish = finish_reason(choice.get("finish_reason"), "choices[0].finish_reason")  # first: a partial answer is moot
    message = choice.get("message")
    if not isinstance(message, dict):
        raise PolicyResponseError("choices[0] has no message object")
    content = message.get("content")
    text = _text(content)
    tool_calls, wire_calls = _tool_calls(message.get("tool_calls"))
    if finish in CUT_OFF:
        # cut off at max_tokens or by a filter: a call it was writing may be unfinished, its arguments cut short, so
        # no call of the turn runs (the episode ends TRUNCATED), as the tito parser never reads one from a cut sample
        tool_calls, wire_calls = [], []

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
    usage = data.get("usage")
    sampled = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if completion_ids is not None and type(sampled) is int and sampled != len(completion_ids):
        raise PolicyTokenError(
            f"the answer carries {len(completion_ids)} token ids ({ids_at}) but says it sampled {sampled} "
            "(usage.completion_tokens)"
        )
    if completion_ids == [] and (text or tool_calls):
        # none for a turn that wrote something: they are missing, never the turn's tokens (its text would come back
        # as the next prompt's, and count as an observation the policy never sampled)
        completion_ids = logprobs = None
    elif completion_ids == [] and ids_at == "choices[0].token_ids":
        # vLLM's sampled ids hold the stop token a finished request ends with: none is a broken server, whose empty
        # turn was scored as the policy's answer (logprob entries, an OpenAI-style server's, leave the stop out: an
        # empty answer there has none, and is the policy's)
        raise PolicyResponseError("the server sampled no tokens (a finished request returns at least its stop token)")

    raw_message: dict[str, Any] = {"role": "assistant", "content": content if isinstance(content, str) else text}
    if content is None:
        raw_message["content"] = None if wire_calls else ""
    if wire_calls:
        raw_message["tool_calls"] = wire_calls
    return Completion(
        text=text,
        tool_calls=tool_calls,
        finish_reason=finish,
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        logprobs=logprobs,
        model=served_model(data.get("model"), model),
        raw_message=raw_message,
    )
