"""Checks that an adapter's token arrays are, id for id, what the model server double sampled.

Every adapter hands its trainer a prompt and a response (or completion) with a mask: 1 on the ids the policy
sampled, 0 on the observations the chat template put between turns. These compare them with the double's own log
(`ScriptedServer.samples`): the prompt is the first sample's, each sample's ids sit exactly where the double saw its
context end, the mask is 1 on those positions and nowhere else, the logprobs are the double's (0.0 elsewhere), and
nothing follows the last sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from orchestrator.testing.scripted_policy import Sample, ScriptedServer


def samples_of(server: ScriptedServer, user: str) -> list[Sample]:
    """The double's samples for one rollout id (or request id), in turn order."""
    return sorted((s for s in server.samples if s.user == user), key=lambda s: s.turn)


def observation_text(result: str) -> str:
    """What the Qwen-like template writes after an assistant turn for one tool result, up to the next generation
    prompt (as Qwen3's does): written out by hand, so the adapters' deltas are checked against the template."""
    return f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def assert_sampled(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    mask: Sequence[int],
    logprobs: Sequence[float] | None,
    samples: Sequence[Sample],
    *,
    float32: bool = False,
) -> list[list[int]]:
    """Assert the arrays are the samples with observations between them; returns the observation spans.

    float32: the logprobs crossed the gRPC wire (float32), so they are compared bit for bit at that precision."""
    assert samples, "the double sampled nothing for this rollout"
    assert len(response_ids) == len(mask), (len(response_ids), len(mask))
    assert list(prompt_ids) == samples[0].prompt_ids, "the prompt is not the one the double saw first"
    context = [*prompt_ids, *response_ids]
    sampled: list[int] = []
    observations: list[list[int]] = []
    at = len(prompt_ids)
    for s in samples:
        assert context[: len(s.prompt_ids)] == s.prompt_ids, f"turn {s.turn}: the double saw another context"
        if s.turn:
            observations.append(context[at : len(s.prompt_ids)])
        at = len(s.prompt_ids)
        assert context[at : at + len(s.ids)] == s.ids, f"turn {s.turn}: the sampled ids differ"
        sampled += range(at - len(prompt_ids), at - len(prompt_ids) + len(s.ids))
        at += len(s.ids)
    assert at == len(context), "tokens after the last sample"
    assert [i for i, m in enumerate(mask) if m == 1] == sampled, "the mask is not 1 exactly on the sampled ids"
    assert set(mask) <= {0, 1}
    if logprobs is not None:
        assert len(logprobs) == len(response_ids)
        dtype = np.float32 if float32 else np.float64
        got = np.array([logprobs[i] for i in sampled], dtype=dtype)
        assert np.array_equal(got, np.array([lp for s in samples for lp in s.logprobs], dtype=dtype))
        assert all(logprobs[i] == 0.0 for i, m in enumerate(mask) if m == 0)
    return observations
