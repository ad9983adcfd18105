"""A streamed answer from a hostile policy server (the URL is the tenant's) is held to a byte cap as a whole one is: a
stream that never ends is cut at its cap (`max_response_bytes`, and 1 KiB more for each token max_tokens allows:
test_long_generations.py), and the error describes it without quoting it. Its time is bounded by the longest silence
(request_timeout_s) and, for a server that keeps trickling, by the rollout's own wall-clock limit."""

from __future__ import annotations

import time

import pytest

from orchestrator.core.errors import PolicyResponseError
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy.client import OpenAIPolicy
from tests.security.test_long_generations import streaming_server

SECRET = b"the-other-host-said-this"
ENDLESS = b'data: {"choices": [{"index": 0, "delta": {"content": "' + SECRET + b' "}}]}\n\n'


async def test_an_endless_stream_is_cut_at_the_byte_cap() -> None:
    # a server that answers 200 text/event-stream and sends chunks forever, never `data: [DONE]`
    async with streaming_server([], endless=ENDLESS * 64) as url:
        policy = OpenAIPolicy(
            PolicyEndpoint(base_url=url, stream=True, request_timeout_s=5, max_retries=0),
            max_response_bytes=1 << 20,
        )
        try:
            t0 = time.monotonic()
            messages = [{"role": "user", "content": "hi"}]
            cap = policy.response_cap(policy.request_body(messages, [], Sampling()))
            assert cap == (1 << 20) + 1024 * Sampling().max_tokens
            said = rf"sent more than {cap} bytes; the limit is {cap} bytes"
            with pytest.raises(PolicyResponseError, match=said) as e:
                await policy.complete(messages, [], Sampling())
            assert time.monotonic() - t0 < 10
            assert SECRET.decode() not in str(e.value)
        finally:
            await policy.aclose()
