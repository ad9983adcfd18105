"""How many turns an episode gets: the environment's own limit by default, the smaller of the job's and the
environment's when the job names one. The job's default was 16, which cut every longer environment (swe's 40,
harbor's 64, an author's own) short: a trainer that left it unset saw those episodes TRUNCATED, scored 0. Real gRPC,
jobs and store on the fake backend, the tasks' references replayed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Environment, Rubric, ScoringContext, Task, ToolInvocation
from orchestrator.core.models import JobSpec, RolloutStatus, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.server.convert import job_spec_from_pb
from protos import orchestrator_pb2 as pb
from tests.conftest import TEST_OWNER
from tests.orchestrator.servers import serve

CALLS = 20  # bash calls before the submit: past the old default of 16 turns


def _submitted_one(ctx: ScoringContext) -> float:
    return float(ctx.episode.answer == "1")


class LongEnv(Environment):
    """One task whose reference takes CALLS bash turns and then submits."""

    name = "long-episodes"
    tools = ("bash", "submit")
    max_turns = CALLS + 4
    rubric = Rubric([("submitted", _submitted_one, 1.0)])

    def tasks(self) -> Sequence[Task]:
        steps = [ToolInvocation("bash", {"command": f"echo {i}"}) for i in range(CALLS)]
        return [
            Task(id="long", prompt="work, then submit 1", reference=(*steps, ToolInvocation("submit", {"answer": "1"})))
        ]


def test_an_unset_max_turns_is_the_environments_limit() -> None:
    assert JobSpec(env="e", policy=PolicyEndpoint(base_url=REPLAY_URL)).max_turns == 0
    wire = pb.JobSpec(env="e", policy=pb.PolicyEndpoint(base_url="http://h/v1"))
    assert job_spec_from_pb(wire).max_turns == 0


@pytest.mark.parametrize(
    ("max_turns", "status", "reward"), [(0, RolloutStatus.OK, 1.0), (5, RolloutStatus.TRUNCATED, 0.0)]
)
async def test_an_episode_gets_the_environments_turns_unless_the_job_asks_for_fewer(
    tmp_path: Path, max_turns: int, status: RolloutStatus, reward: float
) -> None:
    backend = FakeBackendConfig(owner=TEST_OWNER)
    async with (
        serve(tmp_path, backend=backend, environments=[f"{__name__}:LongEnv"]) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        spec = JobSpec(
            env=LongEnv.name,
            policy=PolicyEndpoint(base_url=REPLAY_URL),
            tasks=TaskSelection(kind="ids", ids=["long"]),
            max_turns=max_turns,
        )
        job_id = await client.submit(spec)
        async with asyncio.timeout(60):
            (r,) = [r async for r in client.rollouts(job_id)]
    assert (r.status, r.reward) == (status, reward), r.error
    assert sum(t.role == "assistant" for t in r.turns) == (CALLS + 1 if max_turns == 0 else max_turns)
