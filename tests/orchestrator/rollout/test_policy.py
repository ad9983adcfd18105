"""OpenAIPolicy against the real scripted server over real sockets: parsing, exact tokens, retries, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.core.errors import (
    EnvfleetError,
    PolicyConnectionError,
    PolicyError,
    PolicyHTTPError,
    PolicyResponseError,
    PolicyTimeoutError,
    PolicyTokenError,
)
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy import client as client_module
from orchestrator.rollout.policy import http
from orchestrator.rollout.policy.base import ToolCall
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.rollout.policy.parsing import parse_chat_completion
from orchestrator.testing import toy_tokenizer as toy
from orchestrator.testing.scripted_policy import Script, ScriptedServer, start_scripted_server

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a shell command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
        },
    }
]
SCRIPT = Script.model_validate(
    {
        "tasks": {
            "t1": [
                {"content": "Let me look.", "tool_calls": [{"name": "bash", "arguments": {"cmd": "ls -l"}}]},
                {"tool_calls": [{"name": "bash", "arguments": {"cmd": "cat a"}}, {"name": "submit", "arguments": {}}]},
                {"content": "The answer is 42 ✓"},
            ],
            "flaky": [{"content": "ok after a 500", "error_status": 500, "fail_times": 1}],
            "broken": [{"error_status": 500}],
            "throttled": [{"content": "ok after 429s", "error_status": 429, "fail_times": 2}],
            "bad-request": [{"error_status": 400}],
            "hang": [{"hang": True}],
            "hang-once": [{"content": "ok after a hang", "hang": True, "fail_times": 1}],
        }
    }
)
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "What is in the directory?"},
]

PolicyFactory = Callable[..., OpenAIPolicy]


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    s = await start_scripted_server(SCRIPT)
    yield s
    await s.close()


@pytest.fixture
async def make_policy() -> AsyncIterator[PolicyFactory]:
    made: list[OpenAIPolicy] = []

    def make(url: str, **kw: Any) -> OpenAIPolicy:
        p = OpenAIPolicy(PolicyEndpoint(base_url=url, **kw), backoff_base_s=0.01, backoff_cap_s=0.05)
        made.append(p)
        return p

    yield make
    for p in made:
        await p.aclose()


def expected_logprobs(ids: list[int]) -> list[float]:
    return [toy.logprob(t, i) for i, t in enumerate(ids)]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_and_exact_tokens_over_a_multi_turn_episode(
    server: ScriptedServer, make_policy: PolicyFactory, stream: bool
) -> None:
    # streamed, the answer comes in pieces (text, tool call arguments, token ids, logprobs) put back together
    policy = make_policy(server.url, stream=stream)
    msgs = list(MESSAGES)

    c1 = await policy.complete(msgs, TOOLS, Sampling(), user="job7:t1:0")
    assert c1.finish_reason == "tool_calls"
    assert c1.text == "Let me look."
    assert c1.tool_calls == [ToolCall("call_0_0", "bash", json.dumps({"cmd": "ls -l"}))]
    assert json.loads(c1.tool_calls[0].arguments) == {"cmd": "ls -l"}
    assert c1.raw_message["role"] == "assistant" and c1.raw_message["tool_calls"][0]["id"] == "call_0_0"
    assert c1.prompt_ids == toy.prompt_ids(msgs)
    assert c1.completion_ids == toy.completion_ids(c1.raw_message)
    assert c1.logprobs == expected_logprobs(c1.completion_ids)
    assert c1.model == "policy"

    msgs += [c1.raw_message, {"role": "tool", "tool_call_id": "call_0_0", "content": "a\nb\n"}]
    c2 = await policy.complete(msgs, TOOLS, Sampling(), user="job7:t1:0")
    assert [t.name for t in c2.tool_calls] == ["bash", "submit"]
    assert [t.id for t in c2.tool_calls] == ["call_1_0", "call_1_1"]
    assert c2.text == "" and c2.raw_message["content"] is None  # tool calls only: content null, as OpenAI sends it
    # The prefix property, on what the server actually returned: turn 2's prompt extends turn 1's prompt + completion.
    assert c1.prompt_ids is not None and c1.completion_ids is not None and c2.prompt_ids is not None
    assert c2.prompt_ids[: len(c1.prompt_ids) + len(c1.completion_ids)] == c1.prompt_ids + c1.completion_ids

    msgs += [c2.raw_message]
    msgs += [{"role": "tool", "tool_call_id": t.id, "content": "fine"} for t in c2.tool_calls]
    c3 = await policy.complete(msgs, TOOLS, Sampling(), user="job7:t1:0")
    assert (c3.text, c3.tool_calls, c3.finish_reason) == ("The answer is 42 ✓", [], "stop")
    assert c3.completion_ids == [*toy.encode("The answer is 42 ✓"), toy.END]
    assert c3.logprobs == expected_logprobs(c3.completion_ids)

    c4 = await policy.complete(
        [*msgs, c3.raw_message, {"role": "user", "content": "more?"}], [], Sampling(), user="j:t1:0"
    )
    assert (c4.text, c4.finish_reason) == ("done", "stop")  # past the end of the script
    assert server.requests == 4 and server.app.streamed == (4 if stream else 0)


async def test_unknown_task_and_no_user_get_the_default_answer(
    server: ScriptedServer, make_policy: PolicyFactory
) -> None:
    policy = make_policy(server.url)
    for user in ("job:nope:0", ""):
        c = await policy.complete(MESSAGES, [], Sampling(), user=user)
        assert (c.text, c.tool_calls, c.finish_reason) == ("I cannot solve this.", [], "stop")


async def test_a_server_without_tokens_gives_none_never_made_up(make_policy: PolicyFactory) -> None:
    s = await start_scripted_server(SCRIPT, tokens=False)
    try:
        c = await make_policy(s.url).complete(MESSAGES, TOOLS, Sampling(), user="j:t1:0")
    finally:
        await s.close()
    assert c.tool_calls[0].name == "bash"
    assert (c.prompt_ids, c.completion_ids, c.logprobs) == (None, None, None)


async def test_retries_a_500_then_succeeds(server: ScriptedServer, make_policy: PolicyFactory) -> None:
    c = await make_policy(server.url, max_retries=2).complete(MESSAGES, [], Sampling(), user="j:flaky:0")
    assert c.text == "ok after a 500"
    assert (server.requests, server.faults) == (2, 1)


async def test_retries_429(server: ScriptedServer, make_policy: PolicyFactory) -> None:
    c = await make_policy(server.url, max_retries=2).complete(MESSAGES, [], Sampling(), user="j:throttled:0")
    assert c.text == "ok after 429s"
    assert server.requests == 3


async def test_always_500_fails_after_the_retries(server: ScriptedServer, make_policy: PolicyFactory) -> None:
    policy = make_policy(server.url, max_retries=2)
    not_shown = r"HTTP 500 \(\d+ bytes of .*; the body is not shown\) \(attempt 3 of 3\)$"
    with pytest.raises(PolicyHTTPError, match=not_shown) as e:
        await policy.complete(MESSAGES, [], Sampling(), user="j:broken:0")
    assert e.value.status == 500
    assert isinstance(e.value, PolicyError) and isinstance(e.value, EnvfleetError)
    assert server.requests == 3


async def test_retries_are_logged_once_a_minute_per_endpoint(
    server: ScriptedServer, make_policy: PolicyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A server down fails every request of every rollout: a warning per retry was a line per request a few seconds."""
    policy = make_policy(server.url, max_retries=2)
    with caplog.at_level(logging.WARNING, logger="orchestrator.rollout.policy.client"):
        for _ in range(3):
            with pytest.raises(PolicyHTTPError):
                await policy.complete(MESSAGES, [], Sampling(), user="j:broken:0")
    assert server.requests == 9
    assert caplog.text.count("policy request failed (attempt") == 1


async def test_a_4xx_fails_at_once(server: ScriptedServer, make_policy: PolicyFactory) -> None:
    with pytest.raises(PolicyHTTPError, match=r"HTTP 400 \(\d+ bytes of .*; the body is not shown\)") as e:
        await make_policy(server.url, max_retries=5).complete(MESSAGES, [], Sampling(), user="j:bad-request:0")
    assert e.value.status == 400
    assert server.requests == 1


async def test_a_hang_times_out_within_the_request_timeout(server: ScriptedServer, make_policy: PolicyFactory) -> None:
    policy = make_policy(server.url, request_timeout_s=0.3, max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(PolicyTimeoutError, match=r"did not answer within 0.3s"):
        await policy.complete(MESSAGES, [], Sampling(), user="j:hang:0")
    assert 0.25 < time.monotonic() - t0 < 1.5
    with pytest.raises(TimeoutError):  # the builtin mixin
        await policy.complete(MESSAGES, [], Sampling(), user="j:hang:1")


async def test_a_timeout_is_retried(server: ScriptedServer, make_policy: PolicyFactory) -> None:
    c = await make_policy(server.url, request_timeout_s=0.3, max_retries=1).complete(
        MESSAGES, [], Sampling(), user="j:hang-once:0"
    )
    assert c.text == "ok after a hang"
    assert server.requests == 2


async def test_connection_refused_fails_after_the_retries_without_an_outage_wait(make_policy: PolicyFactory) -> None:
    s = await start_scripted_server(SCRIPT)
    url = s.url
    await s.close()
    with pytest.raises(PolicyConnectionError, match=r"unreachable: ConnectError.* \(attempt 3 of 3\)$") as e:
        await make_policy(url, max_retries=2, outage_wait_s=0).complete(MESSAGES, [], Sampling())
    assert isinstance(e.value, ConnectionError)


async def test_a_server_down_is_waited_out_for_outage_wait_s_then_fails_saying_so(make_policy: PolicyFactory) -> None:
    s = await start_scripted_server(SCRIPT)
    url = s.url
    await s.close()
    t0 = time.monotonic()
    with pytest.raises(PolicyConnectionError, match=r"down or busy.* outage_wait_s \(0\.5s\)"):
        await make_policy(url, max_retries=1, outage_wait_s=0.5).complete(MESSAGES, [], Sampling())
    assert 0.45 < time.monotonic() - t0 < 5


async def test_a_rollouts_requests_share_one_wait_and_each_pause_moves_its_limits(make_policy: PolicyFactory) -> None:
    """In a rollout, outage_wait_s bounds all its requests' waits together (http.Waits): per request, a rollout of
    many turns against a server that comes and goes could wait many times over; and every pause is told before it
    is taken (the runner moves the rollout's end on by it)."""
    s = await start_scripted_server(SCRIPT)
    url = s.url
    await s.close()
    policy = make_policy(url, max_retries=0, outage_wait_s=10)
    moved: list[float] = []
    waits = http.Waits(0.4, moved.append)
    token = http.PROGRESS.set(http.Progress(waits=waits))
    try:
        spent = r"its rollout waited 0\.[1-4]s in all for the server down or busy, all of outage_wait_s \(10s\)\)$"
        with pytest.raises(PolicyConnectionError, match=spent):
            await policy.complete(MESSAGES, [], Sampling())
        waited = waits.waited
        with pytest.raises(PolicyConnectionError, match=spent):
            await policy.complete(MESSAGES, [], Sampling())  # what is left is less than a pause or two
    finally:
        http.PROGRESS.reset(token)
    assert moved and sum(moved) == pytest.approx(waits.waited) and 0 < waited <= waits.waited <= 0.4
    assert waits.left == pytest.approx(0.4 - waits.waited)


async def test_a_server_down_past_outage_wait_s_counts_as_gone_until_it_answers(
    make_policy: PolicyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server down for good, or a port mistyped, held each rollout of a job outage_wait_s before its POLICY_ERROR:
    a job of thousands took hours to fail. Past outage_wait_s it counts as gone, and each request fails after its
    retries, until one is answered (any answer but a 429, 502 or 503) or none has found it down for DOWN_GAP_S (no
    traffic: a server stopped after one job and loading for the next counted as gone at once): then the next outage
    is waited out again."""
    monkeypatch.setattr(client_module, "DOWN_GAP_S", 0.5)
    s = await start_scripted_server(SCRIPT)
    port, url = s.port, s.url
    await s.close()
    policy = make_policy(url, max_retries=0, outage_wait_s=0.3)
    gone = r"the server down or busy for [\d.]+s, past outage_wait_s \(0\.3s\); it counts as gone"
    t0 = time.monotonic()
    with pytest.raises(PolicyConnectionError, match=gone):
        await policy.complete(MESSAGES, [], Sampling())
    assert time.monotonic() - t0 >= 0.25
    t1 = time.monotonic()
    with pytest.raises(PolicyConnectionError, match=gone):
        await policy.complete(MESSAGES, [], Sampling())
    assert time.monotonic() - t1 < 0.25, "a server known gone was waited for again"
    async with await start_scripted_server(SCRIPT, port=port):
        assert (await policy.complete(MESSAGES, [], Sampling(), user="j:t1:0")).text == "Let me look."
    t2 = time.monotonic()
    with pytest.raises(PolicyConnectionError, match=gone):
        await policy.complete(MESSAGES, [], Sampling())
    assert time.monotonic() - t2 >= 0.25, "after an answer, the next outage is waited out again"
    async with await start_scripted_server(SCRIPT, port=port):  # a 400 is an answer too
        with pytest.raises(PolicyHTTPError, match="HTTP 400"):
            await policy.complete(MESSAGES, [], Sampling(), user="j:bad-request:0")
    t3 = time.monotonic()
    with pytest.raises(PolicyConnectionError, match=gone):
        await policy.complete(MESSAGES, [], Sampling())
    assert time.monotonic() - t3 >= 0.25, "after a 400, the next outage is waited out again"
    await asyncio.sleep(0.6)  # no request for longer than DOWN_GAP_S
    t4 = time.monotonic()
    with pytest.raises(PolicyConnectionError, match=gone):
        await policy.complete(MESSAGES, [], Sampling())
    assert time.monotonic() - t4 >= 0.25, "after a quiet spell, the outage found is a new one, waited out again"


async def test_a_server_that_restarts_mid_request_is_waited_for_not_a_policy_error(make_policy: PolicyFactory) -> None:
    """A trainer's inference server restarting (refused connections, then a 503 while it loads) made every request
    of the time a POLICY_ERROR once its few retries, a second or two, were spent."""
    script = Script.model_validate({"tasks": {"t": [{"content": "back", "error_status": 503, "fail_times": 3}]}})
    s = await start_scripted_server(script)
    port, url = s.port, s.url
    await s.close()
    policy = make_policy(url, max_retries=1, outage_wait_s=30)
    request = asyncio.create_task(policy.complete(MESSAGES, [], Sampling(), user="j:t:0"))
    await asyncio.sleep(0.6)  # refused meanwhile, many times past the one retry
    assert not request.done()
    restarted = await start_scripted_server(script, port=port)
    try:
        c = await asyncio.wait_for(request, 10)
    finally:
        await restarted.close()
    assert c.text == "back"
    assert (restarted.requests, restarted.faults) == (4, 3)  # its 503s waited out too


@pytest.mark.parametrize(("status", "waited"), [(503, True), (502, True), (429, True), (500, False), (504, False)])
async def test_only_a_server_down_or_busy_is_waited_out(make_policy: PolicyFactory, status: int, waited: bool) -> None:
    """A 500 may be this request's own (a server that cannot answer it), and a 504 a proxy's time limit that a long
    generation reaches on every try: asked max_retries more times, not for minutes. 429, 502 and 503 say the server,
    or the proxy in front of it, has no room or no replica yet."""
    script = Script.model_validate({"tasks": {"t": [{"content": "ok", "error_status": status, "fail_times": 4}]}})
    async with await start_scripted_server(script) as s:
        policy = make_policy(s.url, max_retries=1, outage_wait_s=30)
        if waited:
            assert (await policy.complete(MESSAGES, [], Sampling(), user="j:t:0")).text == "ok"
            assert s.requests == 5
        else:
            with pytest.raises(PolicyHTTPError, match=r"\(attempt 2 of 2\)$"):
                await policy.complete(MESSAGES, [], Sampling(), user="j:t:0")
            assert s.requests == 2


async def test_200_concurrent_completions(make_policy: PolicyFactory) -> None:
    s = await start_scripted_server(Script.model_validate({**SCRIPT.model_dump(), "latency_s": 0.05}))
    policy = make_policy(s.url)
    try:
        results = await asyncio.gather(
            *(policy.complete(MESSAGES, TOOLS, Sampling(), user=f"j:t1:{i}") for i in range(200))
        )
    finally:
        await s.close()
    assert all(c.tool_calls[0].id == "call_0_0" and c.completion_ids is not None for c in results)
    assert s.requests == 200


@contextlib.asynccontextmanager
async def _raw_server(
    content_type: str, body: bytes
) -> AsyncIterator[tuple[str, list[tuple[bytes, dict[bytes, bytes], bytes]]]]:
    """A loopback server answering every request with `body`; yields its URL and the requests it read."""
    seen: list[tuple[bytes, dict[bytes, bytes], bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                headers: dict[bytes, bytes] = {}
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = h.partition(b":")
                    headers[name.strip().lower()] = value.strip()
                seen.append((line, headers, await reader.readexactly(int(headers.get(b"content-length", b"0")))))
                head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
                writer.write(head.encode() + body)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/", seen
    finally:
        server.close()


async def test_request_shape() -> None:
    answer = json.dumps({"model": "m", "choices": [{"message": {"content": "hi"}}]}).encode()
    async with _raw_server("application/json", answer) as (url, seen):
        policy = OpenAIPolicy(PolicyEndpoint(base_url=url, model="m", api_key="sk-test"))
        try:
            await policy.complete(MESSAGES, TOOLS, Sampling(temperature=0.5, seed=3, stop=["X"]), user="j:t:0")
            await policy.complete(MESSAGES, [], Sampling())
        finally:
            await policy.aclose()
        endpoint = policy.endpoint
    first, second = (json.loads(body) for _, _, body in seen)
    assert seen[0][0] == b"POST /v1/chat/completions HTTP/1.1\r\n"
    assert seen[0][1][b"authorization"] == b"Bearer sk-test"
    assert seen[0][1][b"content-type"] == b"application/json"
    assert b"accept-encoding" not in seen[0][1]  # nothing is decompressed, so nothing compressed is asked for
    assert first == {
        "model": "m",
        "messages": MESSAGES,
        "stream": False,
        "temperature": 0.5,
        "top_p": 1.0,
        "max_tokens": 1024,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "tools": TOOLS,
        "tool_choice": "auto",
        "seed": 3,
        "stop": ["X"],
        "user": "j:t:0",
    }
    assert not {"tools", "tool_choice", "seed", "stop", "user"} & second.keys()
    assert "sk-test" not in repr(endpoint)


def test_parse_vllm_fallbacks() -> None:
    entries = [{"token": f"token_id:{t}", "logprob": -0.5 * (i + 1)} for i, t in enumerate([7, 8, 9])]
    data: dict[str, Any] = {
        "model": "qwen",
        "choices": [
            {
                "message": {"role": "assistant", "content": "abc", "tool_calls": []},
                "finish_reason": "length",
                "prompt_token_ids": [1, 2, 3],
                "logprobs": {"content": entries},
            }
        ],
    }
    c = parse_chat_completion(data, model="fallback")
    assert (c.prompt_ids, c.completion_ids, c.logprobs) == ([1, 2, 3], [7, 8, 9], [-0.5, -1.0, -1.5])
    assert (c.finish_reason, c.model, c.raw_message) == ("length", "qwen", {"role": "assistant", "content": "abc"})

    # token_ids disagree in length with the logprobs: a policy error, never aligned by guesswork (nor dropped)
    data["choices"][0]["token_ids"] = [7, 8]
    with pytest.raises(PolicyTokenError, match=r"2 token ids \(choices\[0\].token_ids\) but 3 logprobs"):
        parse_chat_completion(data, model="fallback")

    # tokens as text (no return_tokens_as_token_ids) and no token_ids: no ids, logprobs kept
    plain = {"choices": [{"message": {"content": "ab"}, "logprobs": {"content": [{"token": "a", "logprob": -1}]}}]}
    c = parse_chat_completion(plain, model="fallback")
    assert (c.prompt_ids, c.completion_ids, c.logprobs, c.model) == (None, None, [-1.0], "fallback")


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([], "expected a JSON object"),
        ({"choices": []}, "no choices"),
        ({"choices": [{"text": "legacy"}]}, "no message"),
        ({"choices": [{"message": {"content": 5}}]}, "content is a int"),
        ({"choices": [{"message": {"content": "", "tool_calls": [{"function": {}}]}}]}, "no function name"),
    ],
)
def test_parse_rejects_malformed_responses(body: Any, match: str) -> None:
    with pytest.raises(PolicyResponseError, match=match):
        parse_chat_completion(body, model="m")


async def test_non_json_2xx_is_a_response_error() -> None:
    async with _raw_server("text/plain; charset=utf-8", b"<html>") as (url, _):
        policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=0))
        try:
            with pytest.raises(PolicyResponseError, match=r"not JSON \(6 bytes of text/plain; the body is not shown\)"):
                await policy.complete(MESSAGES, [], Sampling())
        finally:
            await policy.aclose()


def test_config_validation() -> None:
    with pytest.raises(ValidationError, match="must start with http"):
        PolicyEndpoint(base_url="localhost:8000/v1")
    with pytest.raises(ValidationError, match="Extra inputs"):
        PolicyEndpoint.model_validate({"base_url": "http://x/v1", "timeout": 3})
    with pytest.raises(ValidationError):
        PolicyEndpoint(base_url="http://x/v1", max_retries=21)
    with pytest.raises(ValidationError):
        Sampling(temperature=2.5)
    with pytest.raises(ValidationError):
        Sampling(top_p=0)
    with pytest.raises(ValidationError):
        Sampling(max_tokens=0)
