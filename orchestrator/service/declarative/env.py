"""An Environment made from an EnvironmentSpec: its image is built from the spec, its tasks are the spec's, and its
score is whatever the spec's scoring command prints."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import re
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any, ClassVar, TypeGuard

import docker

from orchestrator.core.environment import (
    GRADER_CWD,
    GRADER_ENV,
    MAX_SCORE_NAMES,
    Environment,
    Episode,
    Rubric,
    Score,
    Task,
    ToolInvocation,
)
from orchestrator.core.image_spec import ImageSpec
from orchestrator.core.models import MAX_REWARD
from orchestrator.core.sandbox import PROBE_TIMEOUT_S, ExecResult, Sandbox, keeps_time
from orchestrator.images import build_from_spec, build_image, ensure_base_image
from orchestrator.images.build import BuildLimits
from orchestrator.images.resolver import BuildsOwnImage
from orchestrator.service.declarative import dockerfile as dockerfile_check
from orchestrator.service.declarative.errors import ScoringError
from orchestrator.service.declarative.spec import EnvironmentSpec

log = logging.getLogger(__name__)

MAX_SCORING_OUTPUT = 1 << 20
TENANT_BUILD = BuildLimits()  # a spec's build is tenant content: memory, CPU, disk and time limits
# ENVFLEET_ANSWER holds at most this many bytes of UTF-8: the kernel refuses an environment string over 128 KiB
# (MAX_ARG_STRLEN, in bytes) with E2BIG, for the scoring command and for every command it starts.
MAX_ANSWER_ENV = 64 << 10
# What no environment variable can hold (NUL ends a C string; an unpaired surrogate has no UTF-8): ENVFLEET_ANSWER has
# U+FFFD in its place. The exact answer is always in the JSON on stdin.
_NOT_IN_ENV = re.compile("[\x00\ud800-\udfff]")
TAIL_CHARS = 600
# A scoring command past its timeout runs once more, and past it again scores 0: registration checked that it scores
# the reference in time, so a run past it ran the policy's own program that never ends (again), or met a host too
# busy to run it in time (a second run most likely finishes; and a 0 is given only once a trivial command shows the
# sandbox keeps time). A scoring command must bear running twice: its second run finds what its first left. An
# ENV_ERROR, or a rollout that ran out of time in its grader (TIMEOUT), was masked: a way out of a low reward.
SCORING_RERUN_METRIC = "scoring_ran_again_after_timeout"
SCORING_TIMEOUT_METRIC = "scoring_timed_out"
# A scoring command that fails in a rollout (exits non-zero, floods its output, prints no reward) scores 0 the same
# way: registration ran it on a task's reference (`envfleet envs validate`: every task's, and an empty answer), so what
# differs is the policy's answer and files, which it runs or reads. As ENV_ERROR (masked) it was the policy's way out
# of a certain 0: code that calls os._exit(1), or prints past the output cap, when it cannot solve the task. The
# price: a grader that fails on a task no check ran scores 0 there, and says so (the metric below). Checks
# (registration, the checker) score strictly (`strict_scoring`): there the grader's own failure is the finding.
SCORING_FAILED_METRIC = "scoring_failed"
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("envfleet_strict_scoring", default=False)
SCORING_SLACK_S = 5.0  # a scoring command's own start and its reply, twice
# The package check runs at build time, offline: a missing package fails the build with this message.
_PACKAGE_CHECK = (
    "for p in {packages}; do dpkg-query -W -f='${{Status}}' \"$p\" 2>/dev/null | grep -q 'install ok installed' "
    '|| {{ echo "package $p is not installed in the base image (builds are offline: nothing is downloaded)" >&2; '
    "exit 1; }}; done"
)


def image_name(env_name: str) -> str:
    """The image repository of an environment, e.g. env-word-count (docker's naming rules are stricter)."""
    return "env-" + re.sub(r"[._-]+", "-", env_name).strip("-")


def _tail(data: bytes) -> str:
    text = data.decode(errors="replace").strip()
    return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


def answer_env(answer: str | None) -> str:
    """The answer as ENVFLEET_ANSWER carries it: NUL and unpaired surrogates as U+FFFD, cut to MAX_ANSWER_ENV bytes
    of UTF-8 at a character's boundary. Whatever the policy submits fits, so it is graded, never an ENV_ERROR."""
    # cut in characters first (never more than MAX_ANSWER_ENV bytes' worth), so that a policy's 32 MiB answer is not
    # scanned and encoded whole on the event loop, then in bytes
    data = _NOT_IN_ENV.sub("\ufffd", (answer or "")[:MAX_ANSWER_ENV]).encode()
    return data[:MAX_ANSWER_ENV].decode(errors="ignore")  # "ignore" drops only a character the cut split


def parse_score(result: ExecResult, timeout_s: float) -> Score:
    """The Score printed by a scoring command (its last stdout line, a JSON object with a numeric reward)."""
    if result.timed_out:
        raise ScoringError(f"scoring command timed out after {timeout_s:g}s")
    if result.exit_code != 0:
        raise ScoringError(
            f"scoring command exited with code {result.exit_code}: {_tail(result.stderr or result.stdout)}"
        )
    if result.truncated:
        # its output was cut after the first MAX_SCORING_OUTPUT bytes: the last line kept is not its last line (a
        # policy whose code the command runs could print a reward line and then flood stderr past the cut)
        raise ScoringError(
            f"scoring command printed more than {MAX_SCORING_OUTPUT} bytes (stdout and stderr together), so its last "
            "line was lost; print less (send a program's output to a file)"
        )
    lines = [line for line in result.stdout.decode(errors="replace").splitlines() if line.strip()]
    try:
        out = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):  # past the json module's depth or int digits too: what the policy can print
        out = None
    reward = out.get("reward") if isinstance(out, dict) else None
    if isinstance(reward, bool):
        reward = float(reward)  # true or false: 1 or 0, as a component's and a Python reward function's
    if not _finite(reward):
        raise ScoringError(
            'scoring command must print a JSON object with a finite numeric "reward" as its last line; '
            f"its output ended with: {_tail(result.stdout) or '(nothing)'}"
        )
    assert isinstance(out, dict)
    if abs(reward) > MAX_REWARD:
        # a Score refuses it (ENV_ERROR, masked), and the policy's program the command runs could print it
        raise ScoringError(f"scoring command printed a reward of {reward:g}, past ±{MAX_REWARD:g}")
    # a JSON true or false is a component of 1 or 0, as a Python reward function's bool is (it was dropped)
    components = {str(k): float(v) for k, v in out.items() if k != "reward" and (_finite(v) or isinstance(v, bool))}
    if len(components) > MAX_SCORE_NAMES:
        # too many to keep (a Score refuses them: ENV_ERROR, masked, which the policy's program could print)
        components = {}
    return Score(float(reward), components)


def _finite(v: object) -> TypeGuard[int | float]:
    """A JSON number that is a finite float: an integer past a float's range (400 digits) is not, and is no error."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


class DeclarativeEnvironment(Environment, BuildsOwnImage):
    """Base of the classes `make_environment` creates, one per spec (an Environment's identity is class-level)."""

    spec: ClassVar[EnvironmentSpec]
    rubric = Rubric([])  # unused: score() runs the spec's scoring command

    @cached_property
    def _tasks(self) -> tuple[Task, ...]:
        return tuple(
            Task(
                id=t.id,
                prompt=t.prompt,
                data={"data": t.data, "files": t.files},
                reference=tuple(ToolInvocation(c.name, c.arguments) for c in t.reference),
            )
            for t in self.spec.tasks
        )

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def image_spec(self) -> ImageSpec | None:
        """The ImageSpec of a base-plus-files image (None for a Dockerfile or the plain base image)."""
        img = self.spec.image
        if img.dockerfile is not None or img.is_default:
            return None
        run = [_PACKAGE_CHECK.format(packages=" ".join(img.packages))] if img.packages else []
        return ImageSpec(base=img.base or "envfleet/base:latest", files=img.files, run=[*run, *img.setup], env=img.env)

    def image_description(self) -> str:
        """How Describe shows the image."""
        img = self.spec.image
        if img.dockerfile is not None:
            return "built from the spec's Dockerfile"
        if img.is_default:
            return img.base or "envfleet/base"
        return f"built from the spec on {img.base or 'envfleet/base'}"

    def build_image(self, client: docker.DockerClient) -> str:
        """Build (or find cached) this environment's image, offline; returns its tag. Blocking: run in a thread."""
        img = self.spec.image
        name = image_name(self.name)
        if img.dockerfile is not None:  # context: the Dockerfile alone, so nothing of the host can be copied in
            return build_image(
                client,
                name=name,
                dockerfile=img.dockerfile,
                context_files={},
                limits=TENANT_BUILD,
                from_images=dockerfile_check.check(img.dockerfile),
            )
        base = img.base or ensure_base_image(client)
        spec = self.image_spec()
        if spec is None:
            return base
        return build_from_spec(
            client, name=name, spec=spec.model_copy(update={"base": base}), limits=TENANT_BUILD, from_images=[base]
        )

    def _task_json(self, task: Task) -> dict[str, Any]:
        return {"task_id": task.id, "prompt": task.prompt, "data": task.data.get("data", {})}

    async def setup(self, sandbox: Sandbox, task: Task, seed: int) -> None:
        """Write the task's files into the workspace, then run the spec's setup command (task JSON on stdin)."""
        for path, text in dict(task.data.get("files", {})).items():
            await sandbox.write_file(path, text.encode())
        cmd = self.spec.setup_command
        if cmd:
            r = await sandbox.exec(
                ["/bin/sh", "-c", cmd],
                stdin=json.dumps(self._task_json(task)).encode(),
                env={"ENVFLEET_TASK_ID": task.id, "ENVFLEET_SEED": str(seed)},
                timeout=self.tool_timeout_s,
                max_output=MAX_SCORING_OUTPUT,
            )
            if not r.ok:
                what = "timed out" if r.timed_out else f"exited with code {r.exit_code}"
                raise ScoringError(f"setup command {what}: {_tail(r.stderr or r.stdout)}")

    def scoring_timeout_s(self, task: Task) -> float:
        """The scoring command at its timeout, twice (it runs once more after a timeout), and the probe after."""
        return 2 * (self.spec.scoring.timeout_s + SCORING_SLACK_S) + PROBE_TIMEOUT_S

    async def score(self, sandbox: Sandbox, task: Task, episode: Episode) -> Score:
        """Run the scoring command with the episode as JSON on stdin and parse the reward it prints; past its timeout
        it runs once more, and past it again scores 0 (its metrics say which: SCORING_RERUN_METRIC,
        SCORING_TIMEOUT_METRIC); failed, it scores 0 too (SCORING_FAILED_METRIC), but within `strict_scoring`."""
        timeout_s = self.spec.scoring.timeout_s
        r = await self._run_scoring(sandbox, task, episode)
        if not r.timed_out:
            try:
                return parse_score(r, timeout_s)
            except ScoringError as e:
                if _STRICT.get():
                    raise
                await _keeps_time(sandbox)  # a sandbox that cannot run a shell in time is the fleet's failure
                log.info("%s: the scoring command failed on the policy's answer (%s); scored 0", task.id, e)
                return Score(0.0, {}, {SCORING_FAILED_METRIC: 1.0})
        log.info("%s: the scoring command ran past its %gs; running it once more", task.id, timeout_s)
        r = await self._run_scoring(sandbox, task, episode)
        if not r.timed_out:
            try:
                score = parse_score(r, timeout_s)
            except ScoringError as e:
                # the first run, stopped midway, may have left the sandbox so (a patch applied, a file half written):
                # the policy's program that never ends is why, and a masked ENV_ERROR would reward it; unless the
                # host is why the first ran out of time
                await _keeps_time(sandbox)
                log.info("%s: the scoring command's second run failed after the first ran out of time (%s)", task.id, e)
                return Score(0.0, {}, {SCORING_TIMEOUT_METRIC: 1.0})
            return Score(score.reward, score.components, {**score.metrics, SCORING_RERUN_METRIC: 1.0})
        await _keeps_time(sandbox)
        log.info("%s: the scoring command ran past its %gs twice; scored 0", task.id, timeout_s)
        return Score(0.0, {}, {SCORING_TIMEOUT_METRIC: 1.0})

    async def _run_scoring(self, sandbox: Sandbox, task: Task, episode: Episode) -> ExecResult:
        payload = {
            **self._task_json(task),
            "answer": episode.answer,
            "finish": episode.finish,
            "tool_calls": episode.tool_calls,
            "turns": [t.model_dump(exclude_defaults=True) for t in episode.turns],
        }
        scoring = self.spec.scoring
        # a clean grader: no user site, an empty HOME, cwd "/" (a json.py planted in the workspace is not imported
        # by `python3 -c`); the workspace is named in ENVFLEET_WORKSPACE for commands that read the policy's files
        env = {
            "ENVFLEET_TASK_ID": task.id,
            "ENVFLEET_ANSWER": answer_env(episode.answer),
            "ENVFLEET_WORKSPACE": sandbox.spec.workspace,
            **GRADER_ENV,
        }
        # ASCII whatever the answer holds: json escapes NUL, unpaired surrogates and every other non-ASCII character.
        # The policy decides its size (an answer up to 32 MiB, in it twice, each up to six times as long escaped):
        # the transport streams a large stdin in pieces (envd_transport.STREAM_STDIN_OVER)
        return await sandbox.exec(
            ["/bin/sh", "-c", scoring.command],
            cwd=GRADER_CWD,
            stdin=json.dumps(payload).encode(),
            env=env,
            timeout=scoring.timeout_s,
            max_output=MAX_SCORING_OUTPUT,
        )


@contextlib.contextmanager
def strict_scoring() -> Iterator[None]:
    """Within it, a scoring command that fails raises its ScoringError (ENV_ERROR, with the grader's own message)
    instead of scoring 0: for the checks that prove a grader works, never for a policy's rollout."""
    token = _STRICT.set(True)
    try:
        yield
    finally:
        _STRICT.reset(token)


def late_metrics(score: Score) -> list[str]:
    """The metrics by which a score says its scoring command ran past its timeout (none: it ran in time)."""
    return sorted(k for k in score.metrics if k in (SCORING_RERUN_METRIC, SCORING_TIMEOUT_METRIC))


async def _keeps_time(sandbox: Sandbox) -> None:
    await keeps_time(sandbox, "the scoring command ran past its timeout", GRADER_CWD)  # where scoring runs


def make_environment(spec: EnvironmentSpec) -> DeclarativeEnvironment:
    """The Environment a spec describes."""
    attrs: dict[str, Any] = {
        "spec": spec,
        "name": spec.name,
        "version": spec.version,
        "description": spec.description,
        "tools": tuple(spec.tools),
        "system_prompt": spec.system_prompt,
        "limits": spec.limits,
        "runtime": spec.runtime,
        "max_turns": spec.max_turns,
        "tool_timeout_s": spec.tool_timeout_s,
        "min_reference_reward": spec.scoring.min_reference_reward,
        "__doc__": f"The declarative environment {spec.ref()}.",
    }
    cls: type[DeclarativeEnvironment] = type(f"Declarative({spec.ref()})", (DeclarativeEnvironment,), attrs)
    return cls()
