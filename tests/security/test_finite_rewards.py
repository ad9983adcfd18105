"""A reward is a finite number or no reward at all. A scorer's NaN (from a task's own verifier, say: Harbor reads the
reward from a file the task writes) reached the trainer as JSON null on a rollout marked OK, and an infinity as
itself; now the rollout is ENV_ERROR, with a message that says what the scorer returned, on both paths (the server's
own runner and a worker process). Real gRPC, store, scheduler and worker processes on the fake backend."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Environment, Rubric, Score, ScoringContext, Task, ToolInvocation
from orchestrator.core.errors import EnvironmentBroken
from orchestrator.core.models import JobSpec, Rollout, RolloutStatus, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.rollout.step import env_call
from tests.conftest import TEST_OWNER
from tests.orchestrator.servers import serve

ANSWERS = {"nan": "nan", "inf": "inf", "minus-inf": "-inf", "fine": "1"}


def _as_reward(ctx: ScoringContext) -> float:
    return float(ctx.episode.answer or "0")  # the task's "verifier": whatever it says, as a float


class ScorerSaysEnv(Environment):
    """Each task's reward is the answer the reference submits: NaN, an infinity, or 1."""

    name = "scorer-says"
    tools = ("bash", "submit")
    max_turns = 2
    rubric = Rubric([("verifier", _as_reward, 1.0)])

    def tasks(self) -> Sequence[Task]:
        return [
            Task(id=tid, prompt="submit", reference=(ToolInvocation("submit", {"answer": answer}),))
            for tid, answer in ANSWERS.items()
        ]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_score_is_finite(value: float) -> None:
    with pytest.raises(ValueError, match="not a finite number"):
        Score(value)
    with pytest.raises(ValueError, match="component 'x' is"):
        Score(1.0, {"x": value})
    with pytest.raises(ValueError, match="metric 'm' is"):
        Score(1.0, {}, {"m": value})
    with pytest.raises(ValidationError, match="finite number"):
        Rollout(
            id="r",
            job_id="j",
            env="e",
            task_id="t",
            group_id="g",
            sample_index=0,
            status=RolloutStatus.OK,
            reward=value,
        )


def test_a_score_has_at_most_so_many_components_and_metrics() -> None:
    # a verifier's reward.json (the agent's program runs inside test.sh) of 150,000 keys in its 1 MiB made as many
    # map entries in every copy of the rollout: the log, the stream, each trainer's parse
    from orchestrator.core.environment import MAX_SCORE_NAMES

    many = {f"k{i}": 0.0 for i in range(MAX_SCORE_NAMES + 1)}
    with pytest.raises(ValueError, match=f"{MAX_SCORE_NAMES + 1} components; a score has at most {MAX_SCORE_NAMES}"):
        Score(1.0, many)
    with pytest.raises(ValueError, match=f"{MAX_SCORE_NAMES + 1} metrics"):
        Score(1.0, {}, many)
    assert len(Score(1.0, dict(list(many.items())[:MAX_SCORE_NAMES])).components) == MAX_SCORE_NAMES


async def test_a_rubric_that_returns_nan_is_the_environment_broken() -> None:
    rubric = Rubric([("a", lambda ctx: 1.0, 1.0), ("b", lambda ctx: math.nan, 0.5)])
    with pytest.raises(EnvironmentBroken, match="not a finite number"):
        await env_call(rubric.score(None))  # type: ignore[arg-type]


@pytest.mark.parametrize("workers", [0, 1])
async def test_a_non_finite_reward_is_env_error_never_a_scored_rollout(tmp_path: Path, workers: int) -> None:
    backend = FakeBackendConfig(owner=TEST_OWNER)
    environments = [f"{__name__}:ScorerSaysEnv"]
    async with (
        serve(tmp_path, backend=backend, workers=workers, environments=environments) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        job_id = await client.submit(
            JobSpec(
                env=ScorerSaysEnv.name,
                policy=PolicyEndpoint(base_url=REPLAY_URL),
                tasks=TaskSelection(kind="ids", ids=list(ANSWERS)),
            )
        )
        async with asyncio.timeout(60):
            got = {r.task_id: r async for r in client.rollouts(job_id)}
    assert set(got) == set(ANSWERS)
    assert (got["fine"].status, got["fine"].reward) == (RolloutStatus.OK, 1.0)
    for tid in ("nan", "inf", "minus-inf"):
        r = got[tid]
        assert (r.status, r.reward) == (RolloutStatus.ENV_ERROR, None), (tid, r.status, r.reward)
        assert r.error is not None and "not a finite number" in r.error.message, r.error


class OpeningFailsEnv(ScorerSaysEnv):
    """An environment whose opening messages fail for a task (a plug-in's bug)."""

    name = "opening-fails"

    def messages(self, task: Task) -> list[dict[str, Any]]:
        raise KeyError("expected")


async def test_an_environments_opening_messages_that_fail_are_env_error_never_retried(tmp_path: Path) -> None:
    # the hook ran outside the guard that setup and scoring have: its KeyError was unclassified, an INFRA_ERROR,
    # retried on fresh sandboxes and then masked as the fleet's failure
    backend = FakeBackendConfig(owner=TEST_OWNER)
    async with (
        serve(tmp_path, backend=backend, environments=[f"{__name__}:OpeningFailsEnv"]) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        job_id = await client.submit(
            JobSpec(
                env=OpeningFailsEnv.name,
                policy=PolicyEndpoint(base_url=REPLAY_URL),
                tasks=TaskSelection(kind="ids", ids=["fine"]),
            )
        )
        async with asyncio.timeout(60):
            (r,) = [r async for r in client.rollouts(job_id)]
    assert (r.status, r.reward, r.attempts) == (RolloutStatus.ENV_ERROR, None, 1), r
    assert r.error is not None and r.error.kind == "KeyError", r.error
