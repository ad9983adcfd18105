"""The environment checker (`envfleet envs validate NAME`): its image builds, its tasks load, its tools run, and on
every task the reference solution scores at least the environment's `min_reference_reward` (1 by default) while an
empty answer, and an episode cut off with no answer, score at most 0. Run over every built-in by a test."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from orchestrator.core.environment import Environment, Episode, Finish, ImageSource, Score, Task
from orchestrator.core.errors import EnvfleetError, EnvironmentBroken
from orchestrator.core.models import Turn
from orchestrator.core.sandbox import DETERMINISTIC_ENV, Sandbox, SandboxBackend, SandboxSpec
from orchestrator.core.tools import call_tool, get_tools, tool_names
from orchestrator.rollout.step import classify_failure, env_call, env_score, replay_reference
from orchestrator.service.declarative.env import late_metrics, strict_scoring

TOOL_PROBES: dict[str, tuple[dict[str, str], str]] = {
    "bash": ({"command": "echo envfleet-ok"}, "envfleet-ok"),
    "python": ({"code": "print(6 * 7)"}, "42"),
    "write_file": ({"path": "/tmp/envfleet-check.txt", "content": "alpha"}, "wrote"),
    "read_file": ({"path": "/tmp/envfleet-check.txt"}, "alpha"),
    "str_replace": ({"path": "/tmp/envfleet-check.txt", "old_str": "alpha", "new_str": "beta"}, "edited"),
    "submit": ({"answer": "x"}, "submitted"),
}
TOOL_ORDER = ("bash", "python", "write_file", "read_file", "str_replace", "submit")


@dataclass
class CheckReport:
    """What the checker found; `ok` when nothing."""

    env: str
    tasks_checked: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def check_tasks(env: Environment, *, references: bool = True) -> list[str]:
    """Static checks of the task list; `references`: each task needs one (a declarative spec's tasks may have none,
    as its Validate takes them)."""
    problems = []
    tasks = list(env.tasks())
    if not tasks:
        problems.append("tasks(): no tasks")
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        problems.append("tasks(): ids are not unique")
    offered = set(tool_names(env.tools))
    for t in tasks:
        if not t.id or not t.prompt.strip():
            problems.append(f"task {t.id!r}: empty id or prompt")
        if not t.reference:
            if references:
                problems.append(f"task {t.id!r}: no reference solution to check")
        elif any(inv.name not in offered for inv in t.reference):
            problems.append(f"task {t.id!r}: the reference uses a tool the environment does not offer")
    return problems


async def _check_tools(env: Environment, sandbox: Sandbox) -> list[str]:
    problems = []
    tools = {t.name: t for t in get_tools(env.tools)}
    for name in TOOL_ORDER:
        if name not in tools:
            continue
        args, expect = TOOL_PROBES[name]
        if name in ("read_file", "str_replace") and "write_file" not in tools:
            await sandbox.write_file(args["path"], b"alpha")
        result = await call_tool(tools[name], sandbox, json.dumps(args), env.tool_timeout_s)
        if expect not in result.output:
            problems.append(f"tool {name}: expected {expect!r} in its output, got {result.output[:200]!r}")
    return problems


async def _check_task(env: Environment, backend: SandboxBackend, image: str, task: Task, seed: int) -> list[str]:
    spec = SandboxSpec(
        image=image, limits=env.limits, runtime=env.runtime, env={**DETERMINISTIC_ENV, "ENVFLEET_SEED": str(seed)}
    )
    problems = []
    # an empty answer, and an episode cut off before any (its answer None: a scorer's `answer.strip()` made every
    # TRUNCATED rollout ENV_ERROR, masked from training instead of scored); each in a sandbox of its own, as a
    # rollout's scoring is (a grader that leaves state behind is no problem of the checker's making)
    cases: tuple[tuple[str, str | None, Finish], ...] = (
        ("an empty answer", "", "submit"),
        ("no answer (cut off)", None, "max_turns"),
    )
    for what, answer, finish in cases:
        async with await backend.create(spec) as sandbox:
            await env_call(env.setup(sandbox, task, seed))
            opening = [Turn(role="user", text=task.prompt)]
            with strict_scoring():
                try:
                    empty = await env_score(env, sandbox, task, Episode(opening, answer, finish))
                except EnvironmentBroken as e:
                    problems.append(f"task {task.id}: scoring {what} failed: {e}")
                    continue
        if empty.reward > 0:
            problems.append(f"task {task.id}: {what} scores {empty.reward}, expected at most 0")
        problems += _in_time(task, what, empty)
    if not task.reference:
        return problems  # check_tasks says so where a task needs one
    async with await backend.create(spec) as sandbox:
        await env_call(env.setup(sandbox, task, seed))
        episode = await replay_reference(env, sandbox, task)
        with strict_scoring():
            solved = await env_score(env, sandbox, task, episode)
        if solved.reward < env.min_reference_reward - 1e-9:
            problems.append(
                f"task {task.id}: the reference solution scores {solved.reward}, expected at least "
                f"{env.min_reference_reward:g} (the environment's min_reference_reward) ({solved})"
            )
        problems += _in_time(task, "the reference solution", solved)
    return problems


def _in_time(task: Task, what: str, score: Score) -> list[str]:
    """A problem when the grader ran past its timeout for `what`: a 0 it then gives is the policy's program's
    doing in a rollout, and no check that the grader works."""
    late = late_metrics(score)
    return [f"task {task.id}: the scoring command ran past its timeout for {what} ({', '.join(late)})"] if late else []


async def check_environment(
    env: Environment,
    backend: SandboxBackend,
    images: ImageSource,
    *,
    concurrency: int = 8,
    limit: int | None = None,
    references: bool = True,
) -> CheckReport:
    """Run every check on the first `limit` tasks; problems are collected, not raised. `references`: check_tasks's
    (a task without one scores its empty answers, and has no replay, either way)."""
    t0 = time.monotonic()
    report = CheckReport(env.ref())
    report.problems += check_tasks(env, references=references)
    try:
        image, _ = await images.resolve(env)
    except EnvfleetError as e:
        report.problems.append(f"image: {e}")
        report.seconds = time.monotonic() - t0
        return report
    async with await backend.create(SandboxSpec(image=image, limits=env.limits, runtime=env.runtime)) as sandbox:
        report.problems += await _check_tools(env, sandbox)
    tasks = list(env.tasks())[:limit]  # each scores an empty answer; those with a reference replay it too
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, task: Task) -> list[str]:
        async with gate:
            try:
                return await _check_task(env, backend, image, task, i)
            except Exception as e:
                # the same classification as a rollout's: ENV_ERROR is the environment's bug, INFRA_ERROR ours
                status, error = classify_failure(e)
                return [f"task {task.id}: {status.value}: {error.kind}: {error.message}"]

    for problems in await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))):
        report.problems += problems
    report.tasks_checked = len(tasks)
    report.seconds = time.monotonic() - t0
    return report
