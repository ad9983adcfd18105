"""A long generation is the policy's own length, never a masked failure. A stream was read up to a fixed 32 MiB, about
85,000 tokens as vLLM streams them (a chunk of ~400 bytes per token, with its id and logprob entry), so a longer
answer within max_tokens was POLICY_ERROR, masked from training: a policy could learn to ramble out of a low reward.
A stream's cap now grows with its max_tokens. One that passes its cap carrying more tokens than an episode keeps
(KEPT_TOKENS) is GenerationTooLong, and the episode ends TRUNCATED, scored; one whose bytes pass it otherwise (junk,
misaligned tokens, more than max_tokens) is still the server's fault, PolicyResponseError.

Real HTTP from a server of raw sockets, the real client and parser, and the agent loop on the fake backend."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from orchestrator.backends.fake import FakeBackend
from orchestrator.core.errors import GenerationTooLong, PolicyResponseError
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.rollout.episode import run_episode
from orchestrator.rollout.policy.client import KEPT_TOKENS, MAX_RESPONSE_BYTES, OpenAIPolicy
from orchestrator.service.registry import Registry
from tests.orchestrator.servers import FAKE, FAKE_BASE_IMAGE

MESSAGES = [{"role": "user", "content": "hi"}]
MODEL = "Qwen/Qwen3-30B-A3B-Instruct-2507"


def _event(chunk: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def token_chunk(token: int, ids: int = 1, tokens: int = 1) -> bytes:
    """One token as vLLM streams it with logprobs, return_token_ids and return_tokens_as_token_ids (~400 bytes),
    or `tokens` of them in one chunk; `ids` token ids a token against its one logprob entry (1: they line up)."""
    return _event(
        {
            "id": "chatcmpl-0123456789abcdef0123456789abcdef",
            "object": "chat.completion.chunk",
            "created": 1764950000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": " word"},
                    "logprobs": {
                        "content": [
                            {
                                "token": f"token_id:{token}",
                                "logprob": -0.0123456789,
                                "bytes": [32, 119, 111, 114, 100],
                                "top_logprobs": [],
                            }
                        ]
                        * tokens
                    },
                    "finish_reason": None,
                    "token_ids": [token] * ids * tokens,
                }
            ],
        }
    )


def generation(tokens: int) -> bytes:
    """A whole streamed answer of `tokens` tokens, cut at max_tokens (finish_reason "length")."""
    head = _event({"model": MODEL, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    body = b"".join(token_chunk(1000 + i % 5000) for i in range(tokens))
    last = _event({"model": MODEL, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    usage = _event({"model": MODEL, "choices": [], "usage": {"completion_tokens": tokens}})
    return head + body + last + usage + b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def streaming_server(
    answers: list[bytes], endless: bytes = b"", content_type: str = "text/event-stream"
) -> AsyncIterator[str]:
    """A server that answers each request 200 `content_type` (chunked): the first ones with `answers` in turn, the
    rest with `endless` over and over without end."""
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        try:
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n"
            writer.write(head.encode())
            if served < len(answers):
                whole = answers[served]
                served += 1
                for i in range(0, len(whole), 1 << 20):
                    piece = whole[i : i + (1 << 20)]
                    writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return
            framed = f"{len(endless):x}\r\n".encode() + endless + b"\r\n"
            while True:
                writer.write(framed)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()


def _policy(url: str, **caps: int) -> OpenAIPolicy:
    return OpenAIPolicy(PolicyEndpoint(base_url=url, stream=True, request_timeout_s=30, max_retries=0), **caps)


async def test_a_generation_past_32_mib_within_max_tokens_is_a_turn() -> None:
    # 100,000 tokens at vLLM's size: ~40 MB, past the fixed 32 MiB the client read before
    tokens = 100_000
    answer = generation(tokens)
    assert len(answer) > MAX_RESPONSE_BYTES
    async with streaming_server([answer]) as url:
        policy = _policy(url)
        try:
            c = await policy.complete(MESSAGES, [], Sampling(max_tokens=tokens))
        finally:
            await policy.aclose()
    assert c.finish_reason == "length"
    assert c.completion_ids is not None and len(c.completion_ids) == tokens
    assert c.completion_ids[:3] == [1000, 1001, 1002] and c.logprobs is not None and len(c.logprobs) == tokens


async def test_the_default_cap_holds_any_generation_an_episode_could_keep() -> None:
    # a stream of KEPT_TOKENS tokens at 2.5 times vLLM's bytes a token still fits (the bytes are not sent: the cap's
    # arithmetic, which the test above checks against a real stream of its own size)
    policy = _policy("http://127.0.0.1:9/v1")
    try:
        for max_tokens in (KEPT_TOKENS, 1_000_000):
            body = policy.request_body(MESSAGES, [], Sampling(max_tokens=max_tokens))
            assert policy.response_cap(body) >= KEPT_TOKENS * 1000
        # a whole (unstreamed) answer is far smaller a token and keeps its fixed cap
        whole = OpenAIPolicy(PolicyEndpoint(base_url="http://127.0.0.1:9/v1", stream=False))
        assert whole.response_cap(whole.request_body(MESSAGES, [], Sampling(max_tokens=10**6))) == MAX_RESPONSE_BYTES
        await whole.aclose()
    finally:
        await policy.aclose()


async def test_a_stream_past_its_cap_with_more_tokens_than_an_episode_keeps_is_generation_too_long() -> None:
    async with streaming_server([], endless=b"".join(token_chunk(7 + i) for i in range(64))) as url:
        policy = _policy(url, max_response_bytes=64 << 10, kept_tokens=500)
        try:
            with pytest.raises(GenerationTooLong, match=r"more than an episode keeps \(500\)"):
                await policy.complete(MESSAGES, [], Sampling(max_tokens=100_000))
        finally:
            await policy.aclose()


@pytest.mark.parametrize(
    ("endless", "max_tokens"),
    [
        # tokens without end, but max_tokens fits the episode: the cap holds every token asked for, so the server
        # sent more than it was asked to sample
        (b"".join(token_chunk(7 + i) for i in range(64)), 400),
        # text without a token: the server's bytes, not the policy's tokens
        (_event({"choices": [{"index": 0, "delta": {"content": "the-other-host-said-this "}}]}) * 64, 100_000),
        # two ids against one logprob entry a chunk: not tokens a rollout could carry
        (b"".join(token_chunk(7 + i, ids=2) for i in range(64)), 100_000),
        # ids that are not token ids
        (token_chunk(-5) * 64, 100_000),
        # logprob entries that are no sampled tokens' (no ids, no `token_id:N` labels), a thousand a chunk
        (_event({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [0] * 1000}}]}) * 16, 100_000),
        # more tokens than an episode keeps (500), and than max_tokens (520): 550 by the chunk that passes 500
        (b"".join(token_chunk(7 + i, tokens=50) for i in range(8)), 520),
    ],
    ids=["over-max-tokens", "no-tokens", "misaligned", "bad-ids", "junk-logprobs", "past-max-tokens"],
)
async def test_a_stream_past_its_cap_otherwise_is_the_servers_fault(endless: bytes, max_tokens: int) -> None:
    async with streaming_server([], endless=endless) as url:
        policy = _policy(url, max_response_bytes=64 << 10, kept_tokens=500)
        try:
            with pytest.raises(PolicyResponseError, match=r"sent more than \d+ bytes") as e:
                await policy.complete(MESSAGES, [], Sampling(max_tokens=max_tokens))
        finally:
            await policy.aclose()
    assert "the-other-host-said-this" not in str(e.value)


async def test_a_whole_answer_to_a_streams_request_keeps_a_whole_answers_cap() -> None:
    # a stream's cap is for events; a JSON body past the whole answer's cap would be parsed on the event loop
    body = b'{"choices": [{"index": 0, "message": {"content": "' + b"x" * (300 << 10) + b'"}}]}'
    async with streaming_server([body], content_type="application/json") as url:
        policy = _policy(url, max_response_bytes=256 << 10)
        try:
            with pytest.raises(PolicyResponseError, match=r"is \d+ bytes of application/json; the limit is 262144"):
                await policy.complete(MESSAGES, [], Sampling(max_tokens=100_000))
        finally:
            await policy.aclose()


@pytest.mark.parametrize("first_turns", [0, 1], ids=["first-turn", "later-turn"])
async def test_an_episode_whose_answer_is_too_long_ends_truncated(first_turns: int) -> None:
    # the policy calls a tool `first_turns` times, then answers without end
    endless = b"".join(token_chunk(7 + i) for i in range(64))
    call = _event(
        {
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "role": "assistant",
                        "tool_calls": [{"index": 0, "id": "c1", "function": {"name": "nothing", "arguments": "{}"}}],
                    },
                    "finish_reason": "tool_calls",
                }
            ],
        }
    )
    env = Registry.from_entry_points().get("python-tool")
    backend = FakeBackend(FAKE)
    sandbox = await backend.create(SandboxSpec(image=FAKE_BASE_IMAGE, limits=env.limits))
    try:
        async with streaming_server([call + b"data: [DONE]\n\n"] * first_turns, endless) as url:
            policy = _policy(url, kept_tokens=500)
            try:
                sampling = Sampling(max_tokens=100_000)
                result = await run_episode(env, env.tasks()[0], sandbox, policy, sampling, 8, "r", [])
            finally:
                await policy.aclose()
    finally:
        await sandbox.close()
        await backend.close()
    assert result.episode.finish == "length"  # TRUNCATED and scored, not POLICY_ERROR
    roles = [t.role for t in result.episode.turns]
    assert roles.count("assistant") == first_turns and roles[-1] == ("tool" if first_turns else "user")
