"""swe: repository tasks (the shipped SWE dataset) as an RL environment. Tools: bash, read_file, str_replace, submit.

Images: the orchestrator resolves one image per environment, while each instance has its own repository. All
instances of a project share an environment tier, so the sandbox runs the environment tier (`image_spec`) and
`setup` uploads the instance's repository into /workspace: a tar exported once per process from the instance image
(the instance tier, built and checked against base_commit) and cached in memory. Putting every instance's repository
into one image instead would leak the fixes: two mutants of one project hold each other's correct code.

Scoring: the workspace's diff against base_commit (taken with a pristine copy of the repository's git directory, so
whatever the agent did to /workspace/.git does not matter) is graded exactly as `swe-eval` grades a prediction, in a
fresh copy of the pristine repository under /tmp. Reward 1 when resolved, else 0.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from environments.sdk import (
    Environment,
    Episode,
    ImageSpec,
    Rubric,
    Sandbox,
    Score,
    ScoringContext,
    Task,
    ToolInvocation,
)
from environments.swe.builder.pins import INSTANCES
from environments.swe.evaluate import EXEC_MARGIN_S, SWE_LIMITS, EvalOutput, EvaluationError, evaluate_in_sandbox
from environments.swe.grading import FAIL_TO_PASS, PASS_TO_PASS, SETUP_FAILED, Grade, ResolvedStatus
from environments.swe.images import RepoTars, environment_image
from environments.swe.instance import EnvironmentSpec, SweInstance, load_instances
from environments.swe.script import EVAL_ENV
from orchestrator.core.errors import InvalidRequestError, SandboxError, SandboxFileError
from orchestrator.core.sandbox import PROBE_TIMEOUT_S, keeps_time

log = logging.getLogger(__name__)

CLEAR_S = 60.0  # the grader's fresh folder in /tmp
DIFF_S = 120.0  # the workspace's diff against base_commit

WORKSPACE = "/workspace"
GRADE_DIR = "/tmp/swe-grade"
# The grade's first step. /tmp is the agent's to fill and the grade's scratch; what the agent left there has no part
# in the grade (the prediction is the workspace's diff, applied to a fresh copy), and no process of the episode
# outlives its tool call (envd ends them), so it all goes: a full /tmp made the grade's upload fail (ENV_ERROR, a
# rollout masked from training instead of scored 0), and a failed mkdir an INFRA_ERROR retry. Made writable first,
# so a directory of mode 0 goes too; find never follows a link.
CLEAR_TMP = "chmod -R u+rwX /tmp 2>/dev/null; find /tmp -mindepth 1 -delete"
SYSTEM_PROMPT = (
    "You are a software engineer fixing a bug in a Python repository. The repository is checked out in /workspace "
    "(a git repository). Use the tools to explore it, run its tests and edit files. When the issue is fixed, call "
    "submit. Your changes to the files in /workspace are what gets evaluated."
)


def task_prompt(instance: SweInstance) -> str:
    """What the policy is told: the issue, and where the code is."""
    runner = instance.test_runner.framework
    how = "python3 -m pytest" if runner == "pytest" else "python3 -m unittest"
    return (
        f"<issue>\n{instance.problem_statement.strip()}\n</issue>\n\n"
        f"The repository {instance.repo} (version {instance.version}) is in /workspace. "
        f"Its tests run with `{how}` from /workspace"
        + (f" (with PYTHONPATH={':'.join(instance.test_runner.pythonpath)})" if instance.test_runner.pythonpath else "")
        + ". Make the smallest change to the library code that resolves the issue, then call submit."
    )


def _hunks(patch: str) -> list[tuple[str, str, str]]:
    """(path, old text, new text) of every hunk of a unified diff (context lines on both sides)."""
    out: list[tuple[str, str, str]] = []
    path = ""
    old: list[str] = []
    new: list[str] = []
    lines = patch.splitlines(keepends=True)

    def flush() -> None:
        if old or new:
            out.append((path, "".join(old), "".join(new)))
        old.clear()
        new.clear()

    for i, line in enumerate(lines):
        if line.startswith("+++ "):
            flush()
            path = line[4:].strip().removeprefix("b/")
        elif line.startswith("--- ") or line.startswith("diff --git") or line.startswith("@@"):
            flush()
        elif line.startswith("\\"):
            continue
        elif line[:1] in (" ", "-", "+"):
            text = line[1:]
            if i + 1 < len(lines) and lines[i + 1].startswith("\\"):
                text = text.rstrip("\n")
            if line[0] in (" ", "-"):
                old.append(text)
            if line[0] in (" ", "+"):
                new.append(text)
    flush()
    return out


def reference_solution(instance: SweInstance) -> tuple[ToolInvocation, ...]:
    """The gold patch as tool calls: one str_replace per hunk (context included, so the text is unique), then
    submit."""
    calls = [
        ToolInvocation("str_replace", {"path": path, "old_str": old, "new_str": new})
        for path, old, new in _hunks(instance.patch)
    ]
    return (*calls, ToolInvocation("submit", {"answer": "done"}))


# what a grade says of a test run that ran out of time: its timeout, or the script held past it (the output cut)
_OUT_OF_TIME = ("the tests timed out", "the test output is incomplete")
# A test run past its time runs once more on a fresh copy, and past it again is graded as it is, a 0, once a shell
# that does nothing shows the sandbox keeps time: validation ran the gold patch's tests in time, so a run past it is the
# patch's own code that never ends (again), or a host too busy to run them in time (a second run most likely
# finishes). Graded at once, a busy host's doing was a 0 for a correct patch.
TESTS_RERUN_METRIC = "tests_ran_again_after_timeout"


async def _rerun(sandbox: Sandbox, inst: SweInstance, diff: bytes, repo: bytes) -> EvalOutput | None:
    """The tests run again on another fresh, pristine copy of the repository (the first's is within reach of the code
    it ran: a FIFO it left in base/.git held the copy's git); None when this cannot be set up or carried out (a /tmp
    the first run filled, a copy its leftovers stalled): what the first run's code did, not the fleet's failure."""
    root = f"{GRADE_DIR}-{secrets.token_hex(6)}"
    try:
        # /tmp emptied first (the first run's processes are gone, the diff is in memory): its copies left in place,
        # a large repository's second copy ran out of room, and a host's slowness stood as a 0
        r = await sandbox.exec(["/bin/sh", "-c", f"{CLEAR_TMP}; mkdir -p {root}/base"], cwd="/", timeout=CLEAR_S)
        if r.exit_code != 0:
            return None
        await sandbox.upload(repo, f"{root}/base")
        return await evaluate_in_sandbox(sandbox, inst, diff, repo_dir=f"{root}/base", work_dir=f"{root}/work")
    except (EvaluationError, SandboxFileError) as e:
        log.info("%s: the second run of the tests could not be carried out: %s", inst.instance_id, e)
        return None


def ran_out_of_time(grade: Grade) -> bool:
    """Whether the grade is that of a test run that ran out of time."""
    return grade.error is not None and grade.error.startswith(_OUT_OF_TIME)


def checked(grade: Grade) -> Grade:
    """The grade, unless the grader's own set-up of the repository failed before the patch went in (a fresh copy of
    a pristine repository in a /tmp it has just emptied: nothing of the agent's): SWE-bench counts that unresolved,
    but under RL a 0 for it would be an infrastructure failure passed off as a reward, so it is one (SandboxError:
    INFRA_ERROR, retried). A step after the patch that fails may be the patch's doing, and stays graded."""
    if grade.error is not None and grade.error.startswith(SETUP_FAILED):
        raise SandboxError(f"the grader could not set up {grade.instance_id}: {grade.error}")
    return grade


async def workspace_diff(sandbox: Sandbox, instance: SweInstance, git_dir: str, index: str) -> bytes | None:
    """The agent's change: /workspace against base_commit, through a pristine git directory and a private index,
    as git wrote it (bytes: a file that is not UTF-8 keeps its own). None when git cannot read the workspace (the
    agent made it unreadable, or filled the grader's /tmp with it: its own doing, graded as no patch).

    The agent's files become objects in a store of their own beside the index (the pristine one is read through
    GIT_ALTERNATE_OBJECT_DIRECTORIES), and both are removed when the diff is out: written into the pristine git
    directory, which the grader then copies, tens of thousands of small files fit once in /tmp and not twice, and the
    copy's failure ("Reset Failed") made a rollout heading for 0 an infrastructure failure."""
    q = shlex.quote
    objects = f"{index}.objects"
    git = f"git --git-dir={q(git_dir)} --work-tree={WORKSPACE}"
    cmd = (
        f"set -e; trap 'rm -rf {q(index)} {q(objects)}' EXIT; mkdir {q(objects)}; "
        f"export GIT_INDEX_FILE={q(index)} GIT_OBJECT_DIRECTORY={q(objects)} "
        f"GIT_ALTERNATE_OBJECT_DIRECTORIES={q(git_dir + '/objects')}; "
        f"cd {WORKSPACE}; {git} read-tree {instance.base_commit}; "
        f"{git} add -A .; {git} diff --cached --binary {instance.base_commit}"
    )
    r = await sandbox.exec(["bash", "-c", cmd], env=EVAL_ENV, timeout=DIFF_S, max_output=64 << 20)
    if r.timed_out:  # the agent's tree too big to read in time, unless the host is why
        await keeps_time(sandbox, f"the workspace's diff ran past {DIFF_S:g}s")
    if r.exit_code != 0 or r.truncated:
        log.info("%s: no usable workspace diff: %s", instance.instance_id, r.stderr.decode(errors="replace")[-300:])
        return None
    return r.stdout


@dataclass(frozen=True)
class SweScoringContext(ScoringContext):
    """The scoring context with the episode's grade, computed once for every rubric function."""

    grade: Grade


def _grade_of(ctx: ScoringContext) -> Grade:
    if not isinstance(ctx, SweScoringContext):
        raise TypeError("swe rubric functions need the grade: score through SweEnv.score")
    return ctx.grade


def resolved(ctx: ScoringContext) -> float:
    """1 when the workspace's diff resolves the instance (every FAIL_TO_PASS and PASS_TO_PASS test passes)."""
    return float(_grade_of(ctx).resolved)


def patch_applied(ctx: ScoringContext) -> float:
    """A metric: the agent changed something and the diff applied to a pristine copy."""
    return float(_grade_of(ctx).patch_successfully_applied)


def _rate(category: str) -> Callable[[ScoringContext], float]:
    def fn(ctx: ScoringContext) -> float:
        part = (_grade_of(ctx).tests_status or {}).get(category) or {"success": [], "failure": []}
        total = len(part["success"]) + len(part["failure"])
        return len(part["success"]) / total if total else 0.0

    fn.__doc__ = f"A metric: the share of {category} tests that pass."
    return fn


class SweEnv(Environment):
    """Fix a bug in a real Python project; reward 1 when the hidden FAIL_TO_PASS and PASS_TO_PASS tests pass."""

    name = "swe"
    version = "1"
    description = "SWE-bench-style repository tasks (mutants of PyPI projects); reward: resolved."
    tools = ("bash", "read_file", "str_replace", "submit")
    system_prompt = SYSTEM_PROMPT
    limits = SWE_LIMITS
    max_turns = 40
    tool_timeout_s = 120.0
    # every task runs on the same image (the environment tier) and setup rewrites /workspace, so a sandbox reset in
    # place (processes killed, /tmp and /workspace wiped) serves the next task
    reusable = True
    rubric = Rubric(
        [
            ("resolved", resolved, 1.0),
            ("patch_applied", patch_applied, 0.0),
            ("fail_to_pass_rate", _rate(FAIL_TO_PASS), 0.0),
            ("pass_to_pass_rate", _rate(PASS_TO_PASS), 0.0),
        ]
    )

    def __init__(self, dataset: Path | None = None) -> None:
        self.dataset = dataset or INSTANCES
        self._repos = RepoTars()

    @cached_property
    def instances(self) -> dict[str, SweInstance]:
        """The dataset by instance id."""
        return {i.instance_id: i for i in load_instances(self.dataset)}

    @cached_property
    def environment(self) -> EnvironmentSpec:
        """One environment tier for every instance: the union of their pinned requirements."""
        reqs: dict[str, str] = {}
        for inst in self.instances.values():
            for r in inst.environment.requirements:
                name = r.split("==")[0].lower()
                if reqs.setdefault(name, r) != r:
                    raise InvalidRequestError(f"instances pin {name} differently: {reqs[name]} and {r}")
        return EnvironmentSpec(requirements=tuple(reqs.values()))

    @cached_property
    def _env_image(self) -> str:
        return environment_image(self._repos.client(), self.environment)

    def image_spec(self) -> ImageSpec:
        """The environment tier (built here: the resolver calls this in a thread)."""
        return ImageSpec(base=self._env_image)

    def image_description(self) -> str:
        """The tier, without building it (List and Describe run on the event loop)."""
        return f"the SWE environment tier of {self.dataset} (built on first use)"

    def tasks(self) -> Sequence[Task]:
        return [
            Task(
                id=inst.instance_id,
                prompt=task_prompt(inst),
                data={"instance_id": inst.instance_id},
                reference=reference_solution(inst),
            )
            for inst in sorted(self.instances.values(), key=lambda i: i.instance_id)
        ]

    def instance(self, task: Task) -> SweInstance:
        """The instance behind a task."""
        try:
            return self.instances[str(task.data["instance_id"])]
        except KeyError:
            raise InvalidRequestError(f"task {task.id!r} is not an instance of {self.dataset}") from None

    async def setup(self, sandbox: Sandbox, task: Task, seed: int) -> None:
        """Put the repository at base_commit into /workspace."""
        inst = self.instance(task)
        env_image = await asyncio.to_thread(lambda: self._env_image)
        await sandbox.upload(await self._repos.tar(inst, env_image), WORKSPACE)

    def scoring_timeout_s(self, task: Task) -> float:
        """A fresh folder, the repository's upload and the workspace's diff, then the instance's tests with their
        script's margin; the folder, the upload and the tests again for a rerun (_rerun), and the probe after it.
        Past it the rollout is TIMEOUT, masked: a rerun the budget left out was a policy's way out of a 0."""
        tests = self.instance(task).test_runner.timeout_s + EXEC_MARGIN_S
        return 2 * (CLEAR_S + self.tool_timeout_s + tests) + DIFF_S + PROBE_TIMEOUT_S

    async def grade(self, sandbox: Sandbox, task: Task) -> Grade:
        """Grade the workspace as a prediction: its diff, on a fresh pristine copy, with the instance's tests."""
        grade, _ = await self._grade(sandbox, task)
        return grade

    async def _grade(self, sandbox: Sandbox, task: Task) -> tuple[Grade, bool]:
        """The grade, and whether the tests ran again after a first run ran out of time (TESTS_RERUN_METRIC)."""
        inst = self.instance(task)
        env_image = await asyncio.to_thread(lambda: self._env_image)
        # a fresh, unpredictable folder: nothing the agent left in /tmp can be in the way
        root = f"{GRADE_DIR}-{secrets.token_hex(6)}"
        base = f"{root}/base"
        # from "/": the workspace is the agent's, and one it made unenterable (chmod 000) failed this step, an
        # infrastructure failure (masked) instead of its grade
        r = await sandbox.exec(["/bin/sh", "-c", f"{CLEAR_TMP}; mkdir -p {base}"], cwd="/", timeout=CLEAR_S)
        if r.exit_code != 0:
            raise SandboxError(f"could not create {base}: {r.stderr.decode(errors='replace')[-300:]}")
        repo = await self._repos.tar(inst, env_image)
        await sandbox.upload(repo, base)
        diff = await workspace_diff(sandbox, inst, f"{base}/.git", f"{root}/agent.index")
        if diff is None or not diff.strip():
            # nothing (usable) changed: not resolved, as SWE-bench grades an empty patch, without a test run
            why = "empty patch" if diff is not None else "the workspace could not be read"
            return Grade(task.id, False, False, False, None, ResolvedStatus.NO, None, why, {}), False
        first: EvalOutput | None
        try:
            first = await evaluate_in_sandbox(sandbox, inst, diff, repo_dir=base, work_dir=f"{root}/work")
            why = first.grade.error or ""
        except EvaluationError as e:
            # the script ran past its time before the tests started (applying the patch, putting the tests back):
            # the gold patch did so in time in validation, so it is the patch's doing or the host's, found out as
            # for tests that ran out of time; raised, it was an ENV_ERROR nobody retried
            first, why = None, str(e)
        again = first is None or ran_out_of_time(first.grade)
        out = first
        if again:
            log.info("%s: %s; running them once more", task.id, why)
            second = await _rerun(sandbox, inst, diff, repo)
            if first is None and second is not None and (second.grade.error or "").startswith(SETUP_FAILED):
                return checked(second.grade), again  # no run got past the grader's own set-up: the fleet's failure
            # one that could not be set up or carried out met what the first run's code left: the first's grade
            if second is None or ran_out_of_time(second.grade) or (second.grade.error or "").startswith(SETUP_FAILED):
                await keeps_time(sandbox, f"the tests ran out of time twice ({why})")
            else:
                out = second
        if out is None:  # the host keeps time: the patch held the grader's set-up past its time, twice
            return Grade(task.id, False, True, False, None, ResolvedStatus.NO, None, why, {}), again
        log.debug("%s graded %s (%s)", task.id, out.grade.resolution.value, out.grade.apply_method)
        return checked(out.grade), again

    async def score(self, sandbox: Sandbox, task: Task, episode: Episode) -> Score:
        """Grade the workspace once, then apply the rubric to the grade."""
        grade, again = await self._grade(sandbox, task)
        score = await self.rubric.score(SweScoringContext(sandbox, task, episode, grade))
        if not again:
            return score
        return Score(score.reward, score.components, {**score.metrics, TESTS_RERUN_METRIC: 1.0})
