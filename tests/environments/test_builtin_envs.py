"""Every built-in environment passes the checker, and scores a solving policy 1 and a wrong one 0 end to end."""

from __future__ import annotations

import pytest

from environments.code_tests import CodeTestsEnv
from environments.python_tool import PythonToolEnv, ShapedPythonToolEnv
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Rubric
from orchestrator.core.models import JobSpec, RolloutStatus, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.images.resolver import ImageResolver
from orchestrator.service.checker import check_environment, check_tasks
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import start_scripted_server
from orchestrator.testing.scripts import reference_script

BUILTINS = sorted(
    r.env.name for r in Registry.from_entry_points().all() if r.source.startswith("entry-point:environments.")
)


def test_builtins_are_registered() -> None:
    assert {"python-tool", "code-tests"} <= set(BUILTINS)
    assert len(PythonToolEnv().tasks()) >= 50 and len(CodeTestsEnv().tasks()) >= 30


@pytest.mark.parametrize("name", BUILTINS)
async def test_environment_passes_the_checker(name: str, backend: DockerBackend) -> None:
    env = Registry.from_entry_points().get(name)
    report = await check_environment(env, backend, ImageResolver(backend.client))
    assert report.ok, report.problems
    assert report.tasks_checked == len(env.tasks())


class StripsTheAnswer(PythonToolEnv):
    """A scorer written as `answer.strip()`: an episode cut off (answer None) fails it, ENV_ERROR, masked."""

    name = "python-tool-strips"
    rubric = Rubric([("exact", lambda ctx: float(ctx.episode.answer.strip() == ctx.task.data["answer"]), 1.0)])  # type: ignore[union-attr]


async def test_checker_takes_a_shaped_reward_and_finds_a_scorer_that_fails_on_no_answer(backend: DockerBackend) -> None:
    # the reference had to score exactly 1: the shaped example the README points to (1.19) failed the checker
    shaped = await check_environment(ShapedPythonToolEnv(), backend, ImageResolver(backend.client), limit=2)
    assert shaped.ok and shaped.tasks_checked == 2, shaped.problems
    strips = await check_environment(StripsTheAnswer(), backend, ImageResolver(backend.client), limit=1)
    (problem,) = strips.problems
    assert "scoring no answer (cut off) failed: AttributeError" in problem, problem


def test_checker_finds_broken_tasks() -> None:
    class Broken(PythonToolEnv):
        def tasks(self):  # type: ignore[no-untyped-def]
            good = list(super().tasks())[:1]
            return [*good, good[0]]

    assert "tasks(): ids are not unique" in check_tasks(Broken())


@pytest.mark.parametrize("name", ["python-tool", "code-tests"])
@pytest.mark.parametrize(("mode", "reward"), [("solve", 1.0), ("wrong", 0.0)])
async def test_scripted_policy_through_the_orchestrator(
    name: str, mode: str, reward: float, client: EnvfleetClient
) -> None:
    env = Registry.from_entry_points().get(name)
    tasks = list(env.tasks())[:3]
    server = await start_scripted_server(reference_script(env, tasks, mode=mode))  # type: ignore[arg-type]
    try:
        spec = JobSpec(
            env=name,
            tasks=TaskSelection(kind="ids", ids=[t.id for t in tasks]),
            policy=PolicyEndpoint(base_url=server.url),
        )
        rollouts = [r async for r in client.rollouts(await client.submit(spec))]
    finally:
        await server.close()
    assert len(rollouts) == 3
    for r in rollouts:
        assert r.status == RolloutStatus.OK, r.error
        assert r.reward == reward, (r.task_id, r.reward_components)
