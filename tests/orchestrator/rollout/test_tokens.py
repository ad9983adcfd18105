"""Token accounting: TokenTracker over Completion sequences (complete, missing, inconsistent), then the same through
the scripted policy over HTTP and through a real rollout (orchestrator, Docker)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, get_args

import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import PolicyTokenError
from orchestrator.core.models import RolloutStatus, Tokens, TokenStatus
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy.base import Completion
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.rollout.tokens import TokenTracker
from orchestrator.service.registry import Registry
from orchestrator.testing import toy_tokenizer as toy
from orchestrator.testing.scripted_policy import Script, start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.orchestrator.conftest import ENV, job


def _c(prompt: list[int] | None, completion: list[int] | None, logprobs: list[float] | None = None) -> Completion:
    """A Completion with these arrays; logprobs default to -0.1 per completion token (None stays None)."""
    if logprobs is None and completion is not None:
        logprobs = [-0.1 * (i + 1) for i in range(len(completion))]
    return Completion("", [], "stop", prompt, completion, logprobs, "m", {"role": "assistant", "content": ""})


def _no_logprobs(prompt: list[int], completion: list[int]) -> Completion:
    return Completion("", [], "stop", prompt, completion, None, "m", {"role": "assistant", "content": ""})


@dataclass(frozen=True)
class Case:
    """A sequence of completions and the Tokens the tracker must end with."""

    name: str
    completions: list[Completion]
    expected: Tokens


def _complete(prompt: list[int], completion: list[int], mask: list[int], logprobs: list[float]) -> Tokens:
    return Tokens(
        status="complete",
        prompt_ids=prompt,
        completion_ids=completion,
        completion_mask=mask,
        completion_logprobs=logprobs,
    )


P1, C1, OBS, C2, OBS2, C3 = [1, 2, 3], [10, 11], [4, 5, 6], [12], [7], [13, 14]
MISSING = Tokens(status="missing")
INCONSISTENT = Tokens(status="inconsistent")

CASES = [
    Case("no turn at all", [], MISSING),
    Case(
        "one turn",
        [_c(P1, C1)],
        _complete(P1, C1, [1, 1], [-0.1, -0.2]),
    ),
    Case(
        "observation between turns is masked 0 with logprob 0",
        [_c(P1, C1), _c(P1 + C1 + OBS, C2)],
        _complete(P1, C1 + OBS + C2, [1, 1, 0, 0, 0, 1], [-0.1, -0.2, 0.0, 0.0, 0.0, -0.1]),
    ),
    Case(
        "an empty observation (the next prompt is exactly prompt + completion)",
        [_c(P1, C1), _c(P1 + C1, C2)],
        _complete(P1, C1 + C2, [1, 1, 1], [-0.1, -0.2, -0.1]),
    ),
    Case(
        "three turns: each prompt must extend everything before it",
        [_c(P1, C1), _c(P1 + C1 + OBS, C2), _c(P1 + C1 + OBS + C2 + OBS2, C3)],
        _complete(
            P1,
            C1 + OBS + C2 + OBS2 + C3,
            [1, 1, 0, 0, 0, 1, 0, 1, 1],
            [-0.1, -0.2, 0.0, 0.0, 0.0, -0.1, 0.0, -0.1, -0.2],
        ),
    ),
    Case("first completion without prompt ids", [_c(None, C1, [-0.1, -0.2])], MISSING),
    Case("first completion without completion ids", [_c(P1, None, [-0.1])], MISSING),
    Case("first completion without logprobs", [_no_logprobs(P1, C1)], MISSING),
    Case("missing first, then complete turns: still missing", [_c(None, C1, [-1.0, -1.0]), _c(P1 + C1, C2)], MISSING),
    Case(
        "logprobs on turn 1, None on turn 2: nothing partial is kept", [_c(P1, C1), _no_logprobs(P1 + C1, C2)], MISSING
    ),
    Case("ids on turn 1, none on turn 2", [_c(P1, C1), _c(None, None, None)], MISSING),
    Case(
        "the earlier completion dropped from the next prompt (a template that strips history)",
        [_c(P1, C1), _c(P1 + OBS, C2)],
        INCONSISTENT,
    ),
    Case(
        "the first prompt changed (a rewritten system prompt)", [_c(P1, C1), _c([1, 9, 3, *C1, *OBS], C2)], INCONSISTENT
    ),
    Case("the next prompt shorter than prompt + completion", [_c(P1, C1), _c([*P1, C1[0]], C2)], INCONSISTENT),
    Case("the earlier completion re-tokenized", [_c(P1, C1), _c([*P1, 11, 10, *OBS], C2)], INCONSISTENT),
    Case(
        "inconsistent on turn 3 drops turns 1 and 2 too",
        [_c(P1, C1), _c(P1 + C1 + OBS, C2), _c(P1 + C1 + OBS + OBS2, C3)],
        INCONSISTENT,
    ),
    Case(
        "inconsistent then missing: the first reason stays",
        [_c(P1, C1), _c(P1, C2), _no_logprobs(P1, C3)],
        INCONSISTENT,
    ),
    Case("missing then inconsistent: the first reason stays", [_no_logprobs(P1, C1), _c(P1, C2)], MISSING),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_token_tracker(case: Case) -> None:
    tracker = TokenTracker()
    for c in case.completions:
        tracker.add(c)
    assert tracker.result() == case.expected
    t = tracker.result()
    assert len(t.completion_ids) == len(t.completion_mask) == len(t.completion_logprobs)


@pytest.mark.parametrize(
    ("completions", "match"),
    [
        ([_c(P1, C1, [-0.5])], r"2 token ids \(completion ids\) but 1 logprobs"),
        ([_c(P1, [2**31])], r"completion ids\[0\] is 2147483648: a token id is an int in 0\.\.2147483647"),
        ([_c([1, -1], C1)], r"prompt ids\[1\] is -1"),
        ([_c(P1, C1), _c([*P1, *C1, 5, 2**40], C2)], r"prompt ids\[6\] is 1099511627776"),
        ([_c(P1, C1, [-0.5, float("nan")])], r"logprobs\[1\] is nan \(a float\)"),
    ],
    ids=["lengths", "completion id", "prompt id", "observation id", "logprob"],
)
def test_the_tracker_refuses_what_the_wire_cannot_carry(completions: list[Completion], match: str) -> None:
    """Any Policy's tokens pass the one check the parsers make: a value the wire cannot carry is a policy error."""
    tracker = TokenTracker()
    with pytest.raises(PolicyTokenError, match=match):
        for c in completions:
            tracker.add(c)


def test_token_status_values_match_the_model() -> None:
    assert set(get_args(TokenStatus)) == set(get_args(Tokens.model_fields["status"].annotation))
    with pytest.raises(ValueError, match="complete"):
        Tokens(status="partial")  # type: ignore[arg-type]


# --- through the scripted policy ------------------------------------------------------------------------------------


async def _episode(script: Script, turns: int) -> tuple[Tokens, list[dict[str, Any]]]:
    """Drive `turns` turns of one conversation through OpenAIPolicy, a tool observation after each."""
    server = await start_scripted_server(script)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=server.url, max_retries=0))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "2+2?"}]
    tracker = TokenTracker()
    try:
        for turn in range(turns):
            c = await policy.complete(messages, [], Sampling(), user="j:t:0")
            tracker.add(c)
            messages += [c.raw_message, {"role": "tool", "tool_call_id": f"call_{turn}_0", "content": f"out {turn}"}]
    finally:
        await policy.aclose()
        await server.close()
    return tracker.result(), messages


STEPS = {"t": [{"content": "Let me run it.", "tool_calls": [{"name": "python", "arguments": {"code": "2+2"}}]}] * 3}


async def test_scripted_policy_prefix_template_gives_complete_tokens() -> None:
    tokens, messages = await _episode(Script.model_validate({"tasks": STEPS}), 3)
    assert tokens.status == "complete"
    assert tokens.prompt_ids == toy.prompt_ids(messages[:1])
    # prompt + completion is the tokenized conversation through the last reply (less the next generation prompt)
    assert tokens.prompt_ids + tokens.completion_ids == toy.prompt_ids(messages[:-1])[:-1]
    assert tokens.completion_mask.count(1) == 3 * len(toy.completion_ids(messages[1]))


async def test_scripted_policy_drop_history_template_gives_inconsistent_tokens() -> None:
    script = Script.model_validate({"tasks": STEPS, "template": "drop_history"})
    tokens, _ = await _episode(script, 1)
    assert tokens.status == "complete"  # one turn has nothing to disagree with
    tokens, _ = await _episode(script, 2)
    assert tokens == Tokens(status="inconsistent")


async def test_a_rollout_whose_prompts_do_not_extend_arrives_inconsistent(
    client: EnvfleetClient, task_ids: list[str], registry: Registry
) -> None:
    script = reference_script(registry.get(ENV)).model_copy(update={"template": "drop_history"})
    server = await start_scripted_server(script)
    try:
        job_id = await client.submit(job(server.url, task_ids[:1]))
        (rollout,) = [r async for r in client.rollouts(job_id)]
    finally:
        await server.close()
    # the episode itself is fine and scored; only its tokens cannot be stitched into one exact sequence
    assert rollout.status == RolloutStatus.OK and rollout.reward == 1.0, rollout.error
    assert sum(1 for t in rollout.turns if t.role == "assistant") >= 2
    t = rollout.tokens
    assert t.status == "inconsistent"
    assert t.prompt_ids == t.completion_ids == t.completion_mask == t.completion_logprobs == []
