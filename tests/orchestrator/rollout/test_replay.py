"""The replay policy: each task's reference solution, in process, for measuring the fleet itself."""

from __future__ import annotations

import gc
import json
from typing import ClassVar

import pytest

from orchestrator.core.environment import Environment, Task, ToolInvocation
from orchestrator.core.errors import PolicyResponseError
from orchestrator.core.models import RolloutStatus
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint, Sampling
from orchestrator.rollout.policy.replay import ReplayPolicy
from orchestrator.server.app import Orchestrator
from orchestrator.service.executor import LocalExecutor
from orchestrator.service.registry import Registry
from tests.orchestrator.conftest import ENV, job


async def test_a_job_on_the_replay_policy_solves_every_task(orchestrator: Orchestrator, task_ids: list[str]) -> None:
    spec = job(REPLAY_URL, task_ids[:4], n=2)
    job_id, total = await orchestrator.jobs.submit(spec)
    rollouts = [e.rollout() async for batch in orchestrator.jobs.stream(job_id) for e in batch.entries]
    assert len(rollouts) == total == 8
    assert all(r.status == RolloutStatus.OK and r.reward == 1.0 for r in rollouts), [r.error for r in rollouts]
    assert all(r.tokens.status == "missing" for r in rollouts), "a replay carries no token ids"


async def test_the_replay_policy_refuses_what_it_cannot_answer(registry: Registry) -> None:
    policy = ReplayPolicy(registry.get(ENV))
    with pytest.raises(PolicyResponseError, match="no task for rollout 'job:nope:0'"):
        await policy.complete([], [], Sampling(), user="job:nope:0")
    with pytest.raises(ValueError, match="or be replay://reference"):
        PolicyEndpoint(base_url="ftp://x")


class _Tasks(Environment):
    name: ClassVar[str] = "replayed"

    def __init__(self, answer: str) -> None:
        self.answer = answer

    def tasks(self) -> list[Task]:
        return [Task(id="t", prompt="p", reference=(ToolInvocation("submit", {"answer": self.answer}),))]


async def test_an_executor_replays_each_environment_object_and_forgets_it_with_the_object() -> None:
    """By name@version, a worker kept every replayed environment's tasks for its life, and replayed the first
    object's references for a later one of the same name (another declarative spec, another digest)."""
    executor = LocalExecutor(runner=None)  # type: ignore[arg-type]  # replays need no runner
    first, second = _Tasks("1"), _Tasks("2")
    assert executor._replay(first) is executor._replay(first)
    answers = []
    for env in (first, second):
        c = await executor._replay(env).complete([], [], Sampling(), user="job:t:0")
        answers.append(json.loads(c.tool_calls[0].arguments)["answer"])
    assert answers == ["1", "2"]
    del first, second, env
    gc.collect()
    assert len(executor._replays) == 0
