"""Streamed answers (`PolicyEndpoint.stream`): a generation may take as long as it keeps sending, silence still
times out, and a stream that stops short or reports an error is never a turn. Exactness of the streamed token
fields is checked in test_policy.py (the multi-turn episode, streamed and not)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from orchestrator.core.errors import (
    ContextFull,
    EnvfleetError,
    GenerationAborted,
    PolicyResponseError,
    PolicyTimeoutError,
    PolicyTokenError,
)
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy import client, streaming
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.rollout.policy.parsing import parse_chat_completion
from orchestrator.testing import toy_tokenizer as toy
from orchestrator.testing.policy_app import stream_chunks
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from tests.orchestrator.rollout.test_policy import _raw_server

MESSAGES = [{"role": "user", "content": "Write a long answer."}]
LONG = "a long answer, " * 40

PolicyFactory = Callable[..., OpenAIPolicy]


@pytest.fixture
async def make_policy() -> AsyncIterator[PolicyFactory]:
    made: list[OpenAIPolicy] = []

    def make(url: str, **kw: Any) -> OpenAIPolicy:
        p = OpenAIPolicy(PolicyEndpoint(base_url=url, stream=True, **kw), backoff_base_s=0.01, backoff_cap_s=0.05)
        made.append(p)
        return p

    yield make
    for p in made:
        await p.aclose()


def _sse(*chunks: Any, done: bool = True) -> bytes:
    events = [b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks]
    return b"".join(events) + (b"data: [DONE]\n\n" if done else b"")


def _chunk(content: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


def _label(token_id: int) -> dict[str, Any]:
    return {"token": f"token_id:{token_id}", "logprob": -0.5}


async def test_a_generation_longer_than_the_request_timeout_is_a_turn(make_policy: PolicyFactory) -> None:
    # a whole answer comes at the end of its generation, so one longer than request_timeout_s was a POLICY_ERROR
    # (masked from training; a policy that rambles when it is about to fail learns that); streamed, the timeout
    # is the longest silence: 8 chunks 0.3 s apart under a 1 s timeout
    script = Script(default=[Step(content=LONG, chunk_delay_s=0.3)])
    async with await start_scripted_server(script) as server:
        policy = make_policy(server.url, request_timeout_s=1.0, max_retries=0)
        t0 = time.monotonic()
        c = await policy.complete(MESSAGES, [], Sampling(), user="j:t:0")
        assert time.monotonic() - t0 > 2.0
        assert (c.text, c.finish_reason) == (LONG, "stop")
        assert c.completion_ids == [*toy.encode(LONG), toy.END]
        assert c.logprobs == [toy.logprob(t, i) for i, t in enumerate(c.completion_ids)]
        assert server.app.streamed == 1 and server.requests == 1


@pytest.mark.parametrize("step", [Step(content=LONG, chunk_delay_s=3.0), Step(hang=True)], ids=["pause", "hang"])
async def test_silence_longer_than_the_request_timeout_times_out(make_policy: PolicyFactory, step: Step) -> None:
    async with await start_scripted_server(Script(default=[step])) as server:
        policy = make_policy(server.url, request_timeout_s=0.5, max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(PolicyTimeoutError, match=r"sent nothing for 0.5s"):
            await policy.complete(MESSAGES, [], Sampling(), user="j:t:0")
        assert time.monotonic() - t0 < 2.5


async def test_tool_calls_come_together_from_their_pieces(make_policy: PolicyFactory) -> None:
    calls = [ScriptedToolCall(name="bash", arguments={"cmd": "ls -l " + "x" * 50}), ScriptedToolCall(name="submit")]
    async with await start_scripted_server(Script(default=[Step(content="Looking.", tool_calls=calls)])) as server:
        c = await make_policy(server.url).complete(MESSAGES, [], Sampling(), user="j:t:0")
    assert [(t.id, t.name, json.loads(t.arguments)) for t in c.tool_calls] == [
        ("call_0_0", "bash", {"cmd": "ls -l " + "x" * 50}),
        ("call_0_1", "submit", {}),
    ]
    assert c.text == "Looking." and c.finish_reason == "tool_calls"


def test_the_chunks_of_an_answer_add_up_to_the_answer() -> None:
    whole = {
        "model": "m",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello there", "tool_calls": []},
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5 * t} for t in (7, 8, 9)]},
                "token_ids": [7, 8, 9],
                "finish_reason": "stop",
            }
        ],
        "usage": {"completion_tokens": 3},
    }
    chunks = stream_chunks(whole, usage=True)
    assert len(chunks) == 5  # the role alone, then the three tokens, then the usage
    streamed = parse_chat_completion(streaming.collect(_sse(*chunks)), model="x")
    assert streamed == parse_chat_completion(whole, model="x")
    assert (streamed.prompt_ids, streamed.completion_ids, streamed.logprobs) == ([1, 2, 3], [7, 8, 9], [-3.5, -4, -4.5])


@pytest.mark.parametrize(
    ("body", "error", "match"),
    [
        (_sse(_chunk("half an answer"), done=False), GenerationAborted, r"ended before `data: \[DONE\]`"),
        (_sse(_chunk("half"), {"error": {"message": "engine died"}}), GenerationAborted, r"reported an error"),
        (_sse(b"{not json"), PolicyResponseError, r"stream event 0 is not JSON \(9 bytes\)"),
        (_sse([1, 2]), PolicyResponseError, r"stream event 0 is a list, expected a JSON object"),
        (_sse({"choices": [{"delta": {"content": 7}}]}), PolicyResponseError, r"delta.content is a int"),
        (_sse({"choices": [{"delta": "x"}]}), PolicyResponseError, r"choices\[0\].delta is a str"),
        (
            _sse({"choices": [{"delta": {"tool_calls": [{"index": "0"}]}}]}),
            PolicyResponseError,
            r"tool_calls\[0\].index is not a tool call index",
        ),
        (_sse({"choices": [{"token_ids": 5}]}), PolicyResponseError, r"token_ids is a int, expected a list"),
        (_sse(b"[" * 100_000 + b"]" * 100_000), PolicyResponseError, r"stream event 0 is not JSON"),
        # every server ends a stream with a finish_reason: a cut answer must not pass as a finished one
        (_sse(_chunk("I will now rm")), GenerationAborted, r"ended without a finish_reason"),
        (_sse(_chunk("half"), {"object": "error", "message": "x"}), GenerationAborted, r"reported an error"),
        (
            _sse({"error": {"message": "Requested tokens exceed the model's context length", "code": 400}}),
            ContextFull,
            r"over the model's context",
        ),
        # a server that held chunks back (its tool parser's) sent neither their ids nor their logprobs
        (
            _sse(
                {"choices": [{"delta": {"content": "ab"}, "token_ids": [1, 2], "logprobs": {"content": [{}, {}]}}]},
                {"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 3}},
            ),
            PolicyTokenError,
            r"carried 2 tokens but says it sampled 3",
        ),
        # the same held back from a server that sends no ids, only the `token_id:N` labels of its logprobs
        (
            _sse(
                {"choices": [{"delta": {"content": "ab"}, "logprobs": {"content": [_label(1), _label(2)]}}]},
                {"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 3}},
            ),
            PolicyTokenError,
            r"carried 2 tokens but says it sampled 3",
        ),
        (
            _sse(
                {"choices": [{"delta": {"content": "a"}, "token_ids": [1, 2]}]},
                {"choices": [{"delta": {}, "logprobs": {"content": [{}, {}]}, "finish_reason": "stop"}]},
            ),
            PolicyTokenError,
            r"stream event 0 carries 2 token ids and 0 logprobs",
        ),
    ],
    ids=[
        *("no-done", "error-event", "not-json", "not-object", "content", "delta", "call-index", "token-ids"),
        *("deep", "no-finish", "error-object", "context-full", "ids-held-back", "labels-held-back", "misaligned"),
    ],
)
def test_a_stream_that_stops_short_or_is_malformed_is_no_turn(
    body: bytes, error: type[EnvfleetError], match: str
) -> None:
    with pytest.raises(error, match=match):
        streaming.collect(body)


def test_a_stream_framed_as_the_sse_standard_allows_reads_the_same() -> None:
    # a byte order mark before the first event, and lines ended by CR alone: the first event was dropped (its ids
    # and text with it, the rest still a turn), and a CR-framed stream never ended
    body = _sse(
        {"choices": [{"delta": {"content": "x"}, "token_ids": [7], "logprobs": {"content": [_label(7)]}}]},
        {"choices": [{"delta": {"content": "y"}, "token_ids": [8], "logprobs": {"content": [_label(8)]}}]},
        {"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 2}},
    )
    whole = streaming.collect(body)
    assert whole["choices"][0]["token_ids"] == [7, 8] and whole["choices"][0]["message"]["content"] == "xy"
    for framed in (b"\xef\xbb\xbf" + body, body.replace(b"\n", b"\r"), body.replace(b"\n", b"\r\n")):
        assert streaming.collect(framed) == whole


def test_surrogates_from_the_policy_server_are_text_the_rollout_can_carry() -> None:
    # a lone surrogate's escape (which orjson refuses and the json module keeps) and a pair split between two
    # events: neither is a character, and the rollout holding one could not be stored or sent (UTF-8 has none), so
    # the worker's result failed to encode and the policy's answer ended the rollout as an infrastructure failure
    split = _sse(
        {"choices": [{"delta": {"content": "a\ud83d"}}]},
        {"choices": [{"delta": {"content": "\ude00b"}, "finish_reason": "stop"}]},
    )
    assert streaming.collect(split)["choices"][0]["message"]["content"] == "a\U0001f600b"
    lone = _sse({"choices": [{"delta": {"content": "hi \ud800"}, "finish_reason": "stop"}]})
    assert streaming.collect(lone)["choices"][0]["message"]["content"] == "hi \ufffd"
    whole = b'{"choices": [{"finish_reason": "stop", "message": {"content": "hi \\ud800", "\\udc00k": 1}}]}'
    c = parse_chat_completion(client._loads(whole), model="m")
    assert c.text == "hi \ufffd"
    c.text.encode()


@pytest.mark.parametrize(
    "logprobs", [{"content": [_label(5), None]}, {"content": {"a": 1}}, "none"], ids=["entry", "object", "string"]
)
def test_logprobs_of_another_shape_are_refused_not_read_as_none(logprobs: Any) -> None:
    # a whole answer's malformed logprobs were taken as no logprobs at all: a turn whose tokens were "missing"
    body = {"choices": [{"finish_reason": "stop", "message": {"content": "x"}, "token_ids": [5], "logprobs": logprobs}]}
    with pytest.raises(PolicyTokenError, match=r"choices\[0\]\.logprobs"):
        parse_chat_completion(body, model="m")


def test_a_tool_call_piece_without_its_index_continues_the_call_before_it() -> None:
    body = _sse(
        {
            "choices": [
                {"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}]}}
            ]
        },
        {
            "choices": [
                {"delta": {"tool_calls": [{"function": {"arguments": '"x": 1}'}}]}, "finish_reason": "tool_calls"}
            ]
        },
    )
    c = parse_chat_completion(streaming.collect(body), model="m")
    assert [(t.id, t.name, t.arguments) for t in c.tool_calls] == [("c", "f", '{"x": 1}')]


async def test_a_stream_that_stops_short_is_retried_then_fails(make_policy: PolicyFactory) -> None:
    # the server hung up mid-answer after a 200: the cut answer is never a turn (its finish_reason is absent,
    # which a whole answer's parser takes as finished)
    async with _raw_server("text/event-stream", _sse(_chunk("half an answer"), done=False)) as (url, seen):
        with pytest.raises(GenerationAborted, match=r"ended before .*\(attempt 2 of 2\)"):
            await make_policy(url.rstrip("/"), max_retries=1).complete(MESSAGES, [], Sampling())
    assert len(seen) == 2 and json.loads(seen[0][2])["stream"] is True


async def test_a_server_that_answers_whole_when_asked_to_stream_is_read_whole(make_policy: PolicyFactory) -> None:
    whole = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "all at once"}}]}
    async with _raw_server("application/json", json.dumps(whole).encode()) as (url, _):
        c = await make_policy(url.rstrip("/")).complete(MESSAGES, [], Sampling())
    assert c.text == "all at once"
