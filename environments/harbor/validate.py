"""Validation of an imported Harbor environment on real sandboxes: the image builds offline, the oracle
(solution/solve.sh) passes and an empty solution fails, task by task."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from environments.harbor.env import HarborEnvironment
from environments.harbor.task import HarborRunError
from orchestrator.core.environment import Episode, Score
from orchestrator.core.errors import EnvfleetError
from orchestrator.core.models import Turn
from orchestrator.core.sandbox import DETERMINISTIC_ENV, SandboxBackend, SandboxSpec
from orchestrator.rollout.step import classify_failure, env_call, env_score

SANDBOX_TTL_S = 3 * 3600.0  # a validation sandbox a crashed process left is swept after this
SLACK_S = 60.0


@dataclass
class TaskCheck:
    """One task's validation: the oracle's and the empty solution's rewards, and what went wrong."""

    task_id: str
    oracle: float | None = None
    empty: float | None = None
    problems: list[str] = field(default_factory=list)


async def _run(env: HarborEnvironment, backend: SandboxBackend, image: str, task_id: str, *, empty: bool) -> Score:
    task = next(t for t in env.tasks() if t.id == task_id)
    t = env.harbor_tasks[task_id]
    spec = SandboxSpec(image=image, limits=env.limits, env=dict(DETERMINISTIC_ENV), ttl_s=SANDBOX_TTL_S)
    # every step has its own timeout; this bounds the uploads and file calls between them too
    budget = t.agent_timeout_s + t.verifier_timeout_s + 4 * env.tool_timeout_s + SLACK_S
    try:
        async with asyncio.timeout(budget), await backend.create(spec) as sandbox:
            await env_call(env.setup(sandbox, task, 0))
            r = await env.run_solution(sandbox, task_id, empty=empty)
            if r is not None and r.timed_out:
                raise EnvfleetError(f"solution/solve.sh timed out after {t.agent_timeout_s:g}s")
            episode = Episode([Turn(role="user", text=task.prompt)], "", "submit")
            return await env_score(env, sandbox, task, episode)
    except TimeoutError:
        raise HarborRunError(f"the run did not finish within {budget:g}s") from None


async def check_task(env: HarborEnvironment, backend: SandboxBackend, image: str, task_id: str) -> TaskCheck:
    """Run the oracle and the empty solution; the oracle must score above 0 and above the empty one."""
    out = TaskCheck(task_id)
    for empty in (False, True):
        what = "empty solution" if empty else "oracle (solution/solve.sh)"
        try:
            score = await _run(env, backend, image, task_id, empty=empty)
        except Exception as e:
            status, error = classify_failure(e)
            out.problems.append(f"{what}: {status.value}: {error.message}")
            continue
        if empty:
            out.empty = score.reward
        else:
            out.oracle = score.reward
    if out.oracle is not None and out.oracle <= 0:
        out.problems.append(f"oracle (solution/solve.sh) does not pass: reward {out.oracle:g}")
    if out.oracle is not None and out.empty is not None and out.empty >= out.oracle:
        out.problems.append(f"an empty solution scores {out.empty:g}, not less than the oracle's {out.oracle:g}")
    return out


async def validate(
    env: HarborEnvironment, backend: SandboxBackend, image: str, *, concurrency: int = 2
) -> list[TaskCheck]:
    """Check every task (the image is built already)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(task_id: str) -> TaskCheck:
        async with gate:
            return await check_task(env, backend, image, task_id)

    return list(await asyncio.gather(*(one(t) for t in env.harbor_tasks)))
