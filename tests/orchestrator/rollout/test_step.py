"""One episode step, one outcome classification: the same faults give the same outcome through every entry point
(the agent loop of a job, sessions, the environment checker), on real sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import docker
import pytest

from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.backends.pool import PoolConfig, SandboxPool
from orchestrator.core.environment import Environment, Rubric, ScoringContext, Task, ToolInvocation
from orchestrator.core.errors import (
    EnvironmentBroken,
    PolicyConnectionError,
    PolicyTimeoutError,
    SandboxDiedError,
    SandboxStartTimeoutError,
)
from orchestrator.core.models import JobSpec, RolloutStatus
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.core.sandbox import Limits
from orchestrator.images.resolver import ImageResolver
from orchestrator.rollout import step
from orchestrator.rollout.policy.base import Completion, Policy, ToolCall
from orchestrator.rollout.runner import RolloutRunner, WorkItem
from orchestrator.rollout.step import classify_failure
from orchestrator.service.checker import check_environment
from orchestrator.service.registry import Registry
from orchestrator.service.sessions import FinalAnswer, SessionConfig, SessionManager, ToolAction
from tests.conftest import owned_backend, owned_containers


def _rubric(ctx: ScoringContext) -> float:
    if ctx.task.id == "rubric-raises":
        raise RuntimeError("the rubric itself is broken")
    return 1.0 if ctx.episode.answer == "done" else 0.0


class FaultsEnv(Environment):
    """Each task is one fault; its reference is what the policy does."""

    name = "faults"
    tools = ("bash", "submit")
    tool_timeout_s = 3.0  # room for the outside kill of sandbox-dies to come first
    limits = Limits(memory_mb=256, cpus=0.5, pids=64)
    rubric = Rubric([("done", _rubric, 1.0)])

    def tasks(self) -> Sequence[Task]:
        submit = ToolInvocation("submit", {"answer": "done"})
        return [
            Task("tool-timeout", "sleep", reference=(ToolInvocation("bash", {"command": "sleep 30"}), submit)),
            Task("unknown-tool", "call nope", reference=(ToolInvocation("nope", {}), submit)),
            # killed from outside while its tool call runs (killed_from_outside); nothing inside can kill envd
            Task("sandbox-dies", "die", reference=(ToolInvocation("bash", {"command": f"sleep {DIE_MARK}"}), submit)),
            Task("rubric-raises", "score", reference=(submit,)),
        ]


DIE_MARK = "4242"


@contextlib.asynccontextmanager
async def killed_from_outside(mark: str) -> AsyncIterator[None]:
    """Kill, as an operator's `docker kill` or a crashing engine would, each sandbox of the test suite in which a
    process runs `sleep MARK`, while in the block."""

    async def watch() -> None:
        while True:
            for c in await asyncio.to_thread(owned_containers):
                with contextlib.suppress(docker.errors.APIError):
                    top = await asyncio.to_thread(c.top, ps_args="-eo pid,args")
                    if any(f"sleep {mark}" in " ".join(p) for p in top.get("Processes") or []):
                        await asyncio.to_thread(c.kill)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


@dataclass(frozen=True)
class Outcome:
    """What an entry point reports: the status, and the observation of the first tool call (if it got one)."""

    status: RolloutStatus
    first_observation: str


class ReplayPolicy(Policy):
    """A policy double that makes the task's reference tool calls, one per turn, or fails like a dead server."""

    def __init__(self, task: Task, fail: bool = False) -> None:
        self._calls = list(task.reference)
        self._fail = fail

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, user: str = ""
    ) -> Completion:
        if self._fail:
            raise PolicyConnectionError("the policy server refused the connection")
        inv = self._calls.pop(0)
        call = ToolCall(id=f"c{len(messages)}", name=inv.name, arguments=json.dumps(dict(inv.arguments)))
        raw = {"role": "assistant", "content": "", "tool_calls": []}
        return Completion("", [call], "tool_calls", None, None, None, "replay", raw)

    async def aclose(self) -> None:
        pass


@pytest.fixture
async def fleet(base_image: str) -> AsyncIterator[tuple[DockerBackend, SandboxPool, ImageResolver]]:
    async with owned_backend() as backend:
        pool = SandboxPool(backend, PoolConfig())
        pool.start()
        try:
            yield backend, pool, ImageResolver(backend.client)
        finally:
            await pool.close()


async def via_job(fleet: Any, env: Environment, task: Task, fail_policy: bool = False) -> Outcome:
    _, pool, images = fleet
    runner = RolloutRunner(pool, images)
    spec = JobSpec(env=env.name, policy=PolicyEndpoint(base_url="http://127.0.0.1:9/v1"), max_infra_retries=0)
    item = WorkItem("job", task, 0, time.monotonic())
    rollout = await runner.run(item, env, spec, ReplayPolicy(task, fail_policy), "v1")
    tool_turns = [t for t in rollout.turns if t.role == "tool"]
    return Outcome(rollout.status, tool_turns[0].text if tool_turns else "")


async def via_session(fleet: Any, env: Environment, task: Task) -> Outcome:
    _, pool, images = fleet
    registry = Registry()
    registry.register(env, source="test")
    sessions = SessionManager(SessionConfig(), registry, pool, images)
    try:
        view, _ = await sessions.reset("tenant", env.ref(), task.id)
        first = ""
        for inv in task.reference:
            r = await sessions.step("tenant", view.session_id, ToolAction(inv.name, json.dumps(dict(inv.arguments))))
            first = first or r.observation
            if r.status is not None:
                return Outcome(r.status, first)
        r = await sessions.step("tenant", view.session_id, FinalAnswer("done"))
        assert r.status is not None
        return Outcome(r.status, first)
    finally:
        await sessions.close_all()


async def via_checker(fleet: Any, env: Environment, task: Task) -> str:
    backend, _, images = fleet

    class OneTask(type(env)):  # type: ignore[misc]
        def tasks(self) -> Sequence[Task]:
            return [task]

    report = await check_environment(OneTask(), backend, images)
    return "; ".join(report.problems) or "OK"


# task id -> (the status, a phrase in the first tool observation, a phrase in the checker's report)
FAULTS: dict[str, tuple[RolloutStatus, str, str]] = {
    "tool-timeout": (RolloutStatus.OK, "timed out and was killed", "OK"),
    "unknown-tool": (
        RolloutStatus.OK,
        "error: unknown tool 'nope'; available: bash, submit",
        "the reference uses a tool the environment does not offer",
    ),
    "sandbox-dies": (RolloutStatus.INFRA_ERROR, "", "task sandbox-dies: INFRA_ERROR"),
    "rubric-raises": (RolloutStatus.ENV_ERROR, "submitted", "task rubric-raises: ENV_ERROR: RuntimeError: the rubric"),
}


@pytest.mark.parametrize("task_id", list(FAULTS))
async def test_a_fault_has_one_outcome_through_every_entry_point(fleet: Any, task_id: str) -> None:
    env = FaultsEnv()
    task = next(t for t in env.tasks() if t.id == task_id)
    status, observation, checker_says = FAULTS[task_id]
    async with killed_from_outside(DIE_MARK):
        job_outcome = await via_job(fleet, env, task)
        session_outcome = await via_session(fleet, env, task)
        assert job_outcome.status == session_outcome.status == status
        if status != RolloutStatus.INFRA_ERROR:
            assert observation in job_outcome.first_observation
            assert job_outcome.first_observation == session_outcome.first_observation
        assert checker_says in await via_checker(fleet, env, task)


async def test_a_policy_failure_is_policy_error_never_a_reward(fleet: Any) -> None:
    env = FaultsEnv()
    task = env.tasks()[1]
    outcome = await via_job(fleet, env, task, fail_policy=True)
    assert outcome.status == RolloutStatus.POLICY_ERROR


@pytest.mark.parametrize(
    ("error", "status", "message"),
    [
        (PolicyTimeoutError("slow"), RolloutStatus.POLICY_ERROR, "slow"),
        (SandboxStartTimeoutError("envd"), RolloutStatus.INFRA_ERROR, "envd"),
        (SandboxDiedError("gone"), RolloutStatus.INFRA_ERROR, "gone"),
        (EnvironmentBroken("wrapped"), RolloutStatus.ENV_ERROR, "wrapped"),
        (TimeoutError(), RolloutStatus.TIMEOUT, "the episode exceeded its time limit"),
        (KeyError("bug"), RolloutStatus.INFRA_ERROR, "'bug'"),
    ],
)
def test_classify_failure(error: BaseException, status: RolloutStatus, message: str) -> None:
    got_status, got_error = classify_failure(error)
    assert got_status == status
    assert got_error.message == message
    assert not got_status.scored


def _raised_here(message: str) -> EnvironmentBroken:
    try:
        raise EnvironmentBroken(message)
    except EnvironmentBroken as e:
        return e


def test_an_environments_failure_is_logged_a_few_times_a_place_an_hour(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Once a place and message, a few messages a place, and again after an hour: a place's first messages did not
    silence it for the fleet's weeks."""
    monkeypatch.setattr(step, "_BUGS_LOGGED", {})
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="orchestrator.rollout.step"):
        for message in ["a", "a", "b", "c", "d", "e", "f", "g"]:
            classify_failure(_raised_here(message))
        assert caplog.text.count("an environment failed") == step.MAX_BUGS_PER_PLACE
        now[0] += step.BUG_MEMORY_S
        classify_failure(_raised_here("a"))
    assert caplog.text.count("an environment failed") == step.MAX_BUGS_PER_PLACE + 1
