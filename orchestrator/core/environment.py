"""The environment API: what an environment author writes. Small on purpose.

An environment names an image, a set of tools, its tasks, how to set a task up in a sandbox, and how to score an
episode. Scoring is a rubric of weighted reward functions; a weight of 0 makes a function a metric.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import inspect
import json
import logging
import math
import numbers
import sys
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from orchestrator.core.echo import echo
from orchestrator.core.image_spec import ImageSpec
from orchestrator.core.models import MAX_REWARD, Turn
from orchestrator.core.sandbox import Limits, Sandbox
from orchestrator.core.text import as_text
from orchestrator.core.tools import Tool

log = logging.getLogger(__name__)

# Added to the environment of every grader command run in a sandbox (test runs, scoring commands): no user site
# directory (a usercustomize.py the policy planted under $HOME would run first) and a HOME with nothing in it.
# Graders run `python -I` where they start Python themselves, and from a fixed cwd the policy cannot write to.
GRADER_ENV: Mapping[str, str] = {"HOME": "/nonexistent", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
GRADER_CWD = "/"


@dataclass(frozen=True)
class ToolInvocation:
    """A tool call in a reference solution."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class Task:
    """One task. `data` is for the environment only (answers, hidden tests) and never shown to the policy."""

    id: str
    prompt: str
    data: Mapping[str, Any] = field(default_factory=dict)
    reference: Sequence[ToolInvocation] = ()  # a tool-call path that solves the task, for checks and scripted runs


# How an episode ended: the policy submitted or stopped; or a limit cut it (TRUNCATED): its turns, its context or
# size ("length"), or its share of the rollout's time ("time").
Finish = Literal["submit", "stop", "max_turns", "length", "time"]


@dataclass
class Episode:
    """What happened in one rollout, as the scorer sees it."""

    turns: list[Turn]
    # the argument of `submit`, or the final text when the policy stopped without it; None when the episode was cut
    # off (TRUNCATED: max_turns, length, time) before either: a scorer must take None as no answer, never fail on it
    answer: str | None
    finish: Finish
    tool_calls: int = 0


@dataclass(frozen=True)
class ScoringContext:
    """Everything a reward function may look at. The sandbox is still alive: functions may run commands in it."""

    sandbox: Sandbox
    task: Task
    episode: Episode


RewardFn = Callable[[ScoringContext], float | Awaitable[float]]


MAX_SCORE_NAMES = 256  # components, and metrics, of one score


@dataclass(frozen=True)
class Score:
    """The reward, its named components (weight != 0) and metrics (weight 0). Each a finite number: a NaN would
    reach the trainer as no reward at all (JSON null) on a rollout marked scored, an infinity as a gradient's ruin;
    made inside the environment's scoring, the ValueError makes the rollout ENV_ERROR."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _finite("the reward", self.reward)
        if abs(self.reward) > MAX_REWARD:
            # a group's statistics square it: past this, a group of them made advantages NaN, infinite, or 0
            raise ValueError(f"the reward is {self.reward!r:.40}, past the ±{MAX_REWARD:g} a reward may be")
        for kind, values in (("component", self.components), ("metric", self.metrics)):
            if len(values) > MAX_SCORE_NAMES:
                # each is a map entry of every copy of the rollout (log, stream, trainer): a reward.json of 150,000
                # keys, 1 MiB, was as many of each
                raise ValueError(f"{len(values)} {kind}s; a score has at most {MAX_SCORE_NAMES}")
            for name, value in values.items():
                _finite(f"{kind} {name!r}", value)
            if not all(name.isascii() for name in values):
                # names a scorer read from what the sandbox printed (a reward.json's keys): a lone surrogate made the
                # rollout unstorable, and the job waited for it for ever
                named = {as_text(name): value for name, value in values.items()}
                values.clear()
                values.update(named)


def _finite(what: str, value: object) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value):
        shown = repr(value) if isinstance(value, int | float) else f"a {type(value).__name__}"
        raise ValueError(f"{what} is {shown[:40]}, not a finite number")


@dataclass(frozen=True)
class Rubric:
    """Weighted reward functions: reward = sum(weight * value) over the non-zero weights."""

    functions: Sequence[tuple[str, RewardFn, float]]

    def __post_init__(self) -> None:
        # kept as a tuple: a zip() or a generator was used up by the check below, and every rollout scored 0
        functions = tuple(tuple(f) if isinstance(f, list) else f for f in self.functions)
        object.__setattr__(self, "functions", functions)
        for i, entry in enumerate(functions):
            if not (isinstance(entry, tuple) and len(entry) == 3):
                raise ValueError(f"rubric function {i} is {echo(entry)}, not a (name, function, weight) tuple")
            name, fn, weight = entry
            if not isinstance(name, str) or not name:
                raise ValueError(f"rubric function {i}: its name {echo(name)} is not a non-empty string")
            if not callable(fn):
                raise ValueError(f"rubric function {name!r}: {echo(fn)} is not callable")
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ValueError(f"rubric function {name!r}: its weight {echo(weight)} is not a finite number")
        names = [name for name, _, _ in functions]
        if len(set(names)) != len(names):
            # one name's value took the other's place in the components, while the reward summed both
            raise ValueError(f"rubric function names are not unique: {names}")

    @property
    def pays(self) -> bool:
        """Whether any function has a weight: a rubric of metrics only scores every episode 0."""
        return any(weight != 0 for _, _, weight in self.functions)

    async def score(self, ctx: ScoringContext) -> Score:
        """Run every function (in order) and combine them. A function runs on the server's event loop: one that
        blocks (a sleep, a host-side subprocess or request) holds every rollout of the process meanwhile; run such
        work in the sandbox, or in `asyncio.to_thread`."""
        components: dict[str, float] = {}
        metrics: dict[str, float] = {}
        reward = 0.0
        for name, fn, weight in self.functions:
            try:
                value = fn(ctx)
                if inspect.isawaitable(value):
                    value = await value
            except Exception as e:
                # a KeyError's "'answr'" alone named no function: the trainer and the author saw nothing to go on
                e.add_note(f"in reward function {name!r}")
                raise
            if isinstance(value, str | bytes | bytearray):  # float("1") is 1.0: text is no number a function gives
                raise TypeError(
                    f"reward function {name!r} returned {type(value).__name__} {value[:40]!r}, not a number"
                )
            try:  # a bool counts (a test passed), numpy's numbers and bools too
                value = float(value)
            except (TypeError, ValueError):  # None said "float() argument must be ... 'NoneType'", naming no function
                raise TypeError(f"reward function {name!r} returned {echo(value)}, not a number") from None
            if weight == 0:
                metrics[name] = value
            else:
                components[name] = value
                reward += weight * value
        return Score(reward, components, metrics)


MAX_SCORING_S = 24 * 3600.0  # the most an environment's scoring_timeout_s (or episode_timeout_s) is taken at


def scoring_budget(env: Environment, task: Task) -> float:
    """`env.scoring_timeout_s(task)`, within [0, MAX_SCORING_S]; an environment whose answer is not a number it
    can be (it raised, or said NaN) is logged and given none: a hint, never the rollout's failure."""
    return _seconds(env, task, "scoring_timeout_s")


def episode_budget(env: Environment, task: Task) -> float:
    """`env.episode_timeout_s(task)` as scoring_budget takes its hint: 0, none, when it is not a number it can be."""
    return _seconds(env, task, "episode_timeout_s")


def _seconds(env: Environment, task: Task, hook: str) -> float:
    try:
        s = float(getattr(env, hook)(task))
    except Exception:
        log.exception("%s: %s failed; taken as none (the rollout's own time decides)", env.ref(), hook)
        return 0.0
    return 0.0 if math.isnan(s) else min(max(s, 0.0), MAX_SCORING_S)


class Environment(abc.ABC):
    """Subclass this, set the class attributes, implement `tasks` and a rubric; register it as an entry point in
    the group `envfleet.environments` (name = the environment's name)."""

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ""
    # built-in tools by name, and the environment's own as Tool objects (core/tools.py)
    tools: ClassVar[tuple[str | Tool, ...]] = ("bash", "submit")
    system_prompt: ClassVar[str] = "You are an agent working in a sandbox. Use the tools; call submit when done."
    limits: ClassVar[Limits] = Limits(memory_mb=512, cpus=1.0, pids=128)
    runtime: ClassVar[str] = ""  # the OCI runtime of its sandboxes (SandboxSpec.runtime); empty: the server's default
    max_turns: ClassVar[int] = 16
    tool_timeout_s: ClassVar[float] = 60.0
    rubric: ClassVar[Rubric]
    # The least a task's reference solution scores: the checker (`envfleet envs validate NAME`) runs every task's
    # reference and an empty answer, and wants this much of the one and at most 0 of the other. 1 for an exact-match
    # grader; a shaped reward's best may be more (a declarative spec's scoring.min_reference_reward).
    min_reference_reward: ClassVar[float] = 1.0
    # Reusable sandboxes are reset in place between rollouts instead of destroyed (see orchestrator/backends/pool.py);
    # the workspace is then restored from `workspace_seed`, a directory in the image (empty: an empty workspace).
    reusable: ClassVar[bool] = False
    workspace_seed: ClassVar[str] = ""
    # An expensive, deterministic setup that only touches the workspace: the group's first sample runs it and the
    # others start from its snapshot (orchestrator/rollout/snapshots.py).
    snapshot_setup: ClassVar[bool] = False

    def image_spec(self) -> ImageSpec | None:
        """The image to build FROM the base image, or None to use the base image as it is."""
        return None

    def image_description(self) -> str:
        """How List and Describe show the image; never builds anything (override when image_spec does)."""
        spec = self.image_spec()
        return "envfleet/base" if spec is None else f"built from an ImageSpec on {spec.base or 'envfleet/base'}"

    @abc.abstractmethod
    def tasks(self) -> Sequence[Task]:
        """Every task, in a stable order (ids unique)."""

    def messages(self, task: Task) -> list[dict[str, Any]]:
        """The opening chat messages of an episode."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task.prompt}]

    async def setup(self, sandbox: Sandbox, task: Task, seed: int) -> None:  # noqa: B027 - optional hook
        """Prepare the sandbox for the task (files, repositories...). Default: nothing."""

    def scoring_timeout_s(self, task: Task) -> float:
        """The longest `score` can take, every step of its grader at its own timeout; 0: not known. The rollout
        gives scoring at least this much, past its own time if need be: a grader that runs out of the rollout's time
        (a policy that left a program that never ends, for the grader to wait out) made a masked TIMEOUT of what its
        own timeout scores 0."""
        return 0.0

    def episode_timeout_s(self, task: Task) -> float:
        """The most the agent's episode of `task` may take, its policy calls and tool calls together; 0: the job's
        (its rollout_timeout_s, less what scoring keeps). The shorter of the two ends it as the job's does: the tool
        call running is stopped, the episode is TRUNCATED ("time") and scored as the agent left the sandbox (a
        Harbor task's [agent] timeout_sec)."""
        return 0.0

    async def score(self, sandbox: Sandbox, task: Task, episode: Episode) -> Score:
        """Score an episode with the rubric, before the sandbox is released."""
        return await self.rubric.score(ScoringContext(sandbox, task, episode))

    @classmethod
    def ref(cls) -> str:
        """`name@version`."""
        return f"{cls.name}@{cls.version}"


# each environment object's tasks, in order and by id: its tasks are fixed and their ids unique (the registry checks),
# while some environments build their Task objects at every tasks() call (Harbor, SWE)
_INDEXED: weakref.WeakKeyDictionary[Environment, tuple[Sequence[Task], Mapping[str, Task]]] = (
    weakref.WeakKeyDictionary()
)


def indexed_tasks(env: Environment) -> tuple[Sequence[Task], Mapping[str, Task]]:
    """The environment's tasks, in order and by id, read once per environment object."""
    known = _INDEXED.get(env)
    if known is None:
        tasks = tuple(env.tasks())
        known = _INDEXED[env] = (tasks, {t.id: t for t in tasks})
    return known


_DIGESTS: weakref.WeakKeyDictionary[Environment, str] = weakref.WeakKeyDictionary()


def environment_digest(env: Environment) -> str:
    """What a plug-in environment is where it runs, as a digest: its ref, class and settings, its tasks (ids,
    prompts, data), and the source of the modules of its class and rubric functions. Two processes that loaded the
    same install agree on it; a node with another version of the plug-in (other tasks, another reward function)
    does not. Nothing in it may differ between two processes of one install (an address in a repr, a set's order,
    a .pyc's build time): a false difference refuses every rollout there. "" where it cannot be made (checked by
    nobody). Computed once per environment object."""
    known = _DIGESTS.get(env)
    if known is None:
        try:
            known = _digest(env)
        except Exception:
            log.exception("%s: its digest could not be made; workers will not check their install of it", env.ref())
            known = ""
        _DIGESTS[env] = known
    return known


def _digest(env: Environment) -> str:
    h = hashlib.sha256()

    def put(value: object) -> None:
        # keys as text (JSON's own are; a tuple or mixed keys could not be sorted), and what JSON cannot say by its
        # type's name: a repr may hold an address, other in every process
        h.update(json.dumps(_keyed(value), sort_keys=True, default=lambda o: type(o).__qualname__).encode() + b"\0")

    cls = type(env)
    tools = [t if isinstance(t, str) else [t.name, t.description, t.parameters] for t in env.tools]
    put([env.ref(), cls.__module__, cls.__qualname__, tools, env.system_prompt, env.max_turns])
    put([env.tool_timeout_s, env.limits.model_dump(), env.runtime, env.reusable, env.workspace_seed])
    modules = {cls.__module__}
    for tool in env.tools:  # an environment's own tool: its code's module, as a reward function's
        if isinstance(tool, Tool):
            run = getattr(tool.run, "func", tool.run)
            put([tool.name, getattr(run, "__qualname__", "")])
            modules.add(getattr(run, "__module__", "") or "")
    rubric = getattr(env, "rubric", None)
    for name, fn, weight in getattr(rubric, "functions", ()):
        code = getattr(fn, "func", fn)  # a functools.partial's function
        if not inspect.isfunction(code) and not inspect.ismethod(code):
            code = type(code)  # a callable object: its class (its repr has an address)
        put([name, getattr(code, "__qualname__", ""), weight])
        modules.add(getattr(code, "__module__", "") or "")
    for module in sorted(modules):
        path = getattr(sys.modules.get(module), "__file__", None) or ""
        if path.endswith(".py"):  # the source; a .pyc holds its build time, other in every install
            h.update(Path(path).read_bytes())
    for task in sorted(indexed_tasks(env)[0], key=lambda t: t.id):  # in any order a host lists them
        put([task.id, task.prompt, task.data])
    return h.hexdigest()


def _keyed(value: object, depth: int = 0) -> object:
    """`value` with every mapping's keys as text, to MAX_DIGEST_DEPTH levels (deeper goes by its type's name)."""
    if depth > MAX_DIGEST_DEPTH:
        return type(value).__qualname__
    if isinstance(value, Mapping):
        return {str(k): _keyed(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_keyed(v, depth + 1) for v in value]
    return value


MAX_DIGEST_DEPTH = 32


class ImageSource(Protocol):
    """Where the image an environment runs on comes from: built once per process (Docker) or named (fake)."""

    def ready(self, env: Environment) -> bool:
        """Whether the image exists already, so `resolve` returns at once."""

    async def resolve(self, env: Environment) -> tuple[str, str]:
        """The image's tag and id, built first if needed; raises ImageBuildError when it cannot be built."""

    def prebuild(self, env: Environment) -> asyncio.Task[None]:
        """Start building in the background; the task never raises."""
