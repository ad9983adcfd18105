"""A streamed chat answer must say how many tokens it sampled (`usage`, asked for with stream_options.include_usage)
for its ids to count as complete: a server's tool or reasoning parser may hold a chunk back, sending neither its ids
nor its logprobs, and the two lists stay of one length. A server that ignored include_usage skipped the only check of
that, and on an episode's last turn no later prompt showed the gap: the rollout reached the trainer with its tokens
"complete" and ids missing from them. Such a turn's tokens are now missing, with a warning that says why."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from orchestrator.core.errors import PolicyTokenError
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.rollout.tokens import TokenTracker
from tests.orchestrator.rollout.test_policy import _raw_server

MESSAGES = [{"role": "user", "content": "Use the tool."}]


def _sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _piece(content: str, ids: list[int] | None, finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": content}, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
        choice["logprobs"] = {"content": [{"token": f"token_id:{i}", "logprob": -0.5} for i in ids]}
    return {"choices": [choice]}


FIRST = {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
# four tokens sampled; the parser held the third back and sent its text with the last chunk, its id never
HELD_BACK = [FIRST, _piece("I will ", [7, 8]), _piece("call it", [10], finish="stop")]


async def _turn(body: bytes, stream: bool = True) -> Any:
    content_type = "text/event-stream" if stream else "application/json"
    async with _raw_server(content_type, body) as (url, _):
        policy = OpenAIPolicy(PolicyEndpoint(base_url=url.rstrip("/"), stream=stream, max_retries=0))
        try:
            return await policy.complete(MESSAGES, [], Sampling())
        finally:
            await policy.aclose()


async def test_a_stream_without_usage_never_passes_its_tokens_as_complete(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="orchestrator.rollout.policy.streaming"):
        c = await _turn(_sse(*HELD_BACK))
    assert c.text == "I will call it" and c.finish_reason == "stop"  # the turn itself is taken
    assert c.completion_ids is None and c.logprobs is None
    assert "did not say how many tokens it sampled" in caplog.text and "stream_options.include_usage" in caplog.text
    tracker = TokenTracker()
    tracker.add(c)  # the episode's last turn: no later prompt would show the gap
    tokens = tracker.result()
    assert tokens.status == "missing" and tokens.completion_ids == [] and tokens.completion_mask == []


async def test_a_stream_that_says_what_it_sampled_keeps_or_refuses_its_tokens() -> None:
    said = await _turn(_sse(*HELD_BACK, {"choices": [], "usage": {"completion_tokens": 3}}))
    assert (said.prompt_ids, said.completion_ids, said.logprobs) == ([1, 2, 3], [7, 8, 10], [-0.5] * 3)
    with pytest.raises(PolicyTokenError, match="carried 3 tokens but says it sampled 4"):
        await _turn(_sse(*HELD_BACK, {"choices": [], "usage": {"completion_tokens": 4}}))


async def test_a_whole_answer_without_usage_keeps_its_tokens() -> None:
    # a whole answer's ids are the engine's whole list: no parser holds a chunk of them back
    message = {"role": "assistant", "content": "I will call it"}
    lp = {"content": [{"token": f"token_id:{i}", "logprob": -0.5} for i in (7, 8, 9, 10)]}
    choice = {"index": 0, "message": message, "token_ids": [7, 8, 9, 10], "logprobs": lp, "finish_reason": "stop"}
    c = await _turn(json.dumps({"prompt_token_ids": [1, 2, 3], "choices": [choice]}).encode(), stream=False)
    assert c.completion_ids == [7, 8, 9, 10]


async def test_a_server_that_never_sends_usage_is_warned_of_once_a_minute_not_every_turn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tenant's server that ignores include_usage does on every turn: a line per turn was gigabytes a day."""
    async with _raw_server("text/event-stream", _sse(*HELD_BACK)) as (url, _):
        policy = OpenAIPolicy(PolicyEndpoint(base_url=url.rstrip("/"), stream=True, max_retries=0))
        try:
            with caplog.at_level(logging.WARNING, logger="orchestrator.rollout.policy.streaming"):
                turns = [await policy.complete(MESSAGES, [], Sampling()) for _ in range(5)]
        finally:
            await policy.aclose()
    assert all(c.completion_ids is None for c in turns)  # each turn's tokens still dropped
    assert caplog.text.count("did not say how many tokens it sampled") == 1
