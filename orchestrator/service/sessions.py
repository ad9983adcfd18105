"""Sessions: the trainer drives the agent loop (gym style) while the fleet keeps the sandbox, the tools and scoring.

reset -> one sandbox, the task set up, the first observation; step(action) -> the tool's output, or, at the end of
the episode, the environment's score with the same status taxonomy as rollouts (an infrastructure failure is never a
reward); close -> the sandbox is destroyed. A session idle longer than its TTL expires; its id then answers NOT_FOUND
saying so. Another tenant's session is reported exactly like a missing one, and another tenant's private environment
exactly like a missing environment. A session's sandbox counts against the host's capacity (the scheduler's
admission) from reset until it is released, is capped like any sandbox (`caps.sandbox`), and comes from a warm pool of
the tenant's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import random
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.backends.pool import SandboxPool, pool_labels
from orchestrator.core.echo import echo
from orchestrator.core.environment import (
    Environment,
    Finish,
    ImageSource,
    Task,
    episode_budget,
    indexed_tasks,
    scoring_budget,
)
from orchestrator.core.errors import (
    BusyError,
    EnvironmentBroken,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    SandboxError,
)
from orchestrator.core.models import RolloutError, RolloutStatus, ToolCallRecord, Turn
from orchestrator.core.runtime import run_to_end

# the runner's classification of environment code failures (ENV_ERROR), shared so both paths agree
from orchestrator.core.sandbox import DETERMINISTIC_ENV, Sandbox, SandboxSpec
from orchestrator.core.tools import Tool, get_tools
from orchestrator.rollout.step import (
    EpisodeState,
    classify_failure,
    env_call,
    env_score,
    finished_status,
    opening_turns,
    record_assistant,
    record_turns,
    run_tool_call,
)
from orchestrator.service.caps import SandboxCaps, check_env_limits
from orchestrator.service.registry import Registry
from orchestrator.service.sandbox_health import died, each_checked
from orchestrator.service.scheduler import Need, Reservation, Scheduler

log = logging.getLogger(__name__)

MAX_TOMBSTONES = 10_000
TOMBSTONE_KEEP_S = 3600.0
LEASE_GRACE_S = 60.0
MAX_LEASE_S = 7 * 24 * 3600.0  # SandboxSpec's limit


class SessionConfig(BaseModel):
    """Limits of the session API."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idle_ttl_s: float = Field(600.0, gt=0, le=7 * 24 * 3600, description="a session idle this long expires")
    max_lifetime_s: float = Field(24 * 3600.0, gt=0, le=7 * 24 * 3600, description="hard cap on a session's age")
    max_per_tenant: int = Field(64, ge=1, le=100_000, description="open sessions per tenant")
    scoring_budget_s: float = Field(600.0, gt=0, le=24 * 3600, description="added to the tool timeout per step")
    probe_interval_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="how often an open session's sandbox gets a health check between steps; one whose container died "
        "ends the session (its capacity and the tenant's slot were held until its idle expiry)",
    )


@dataclass(frozen=True)
class Observation:
    """What the policy sees at reset: the prompt, the opening messages and the tools it may call."""

    text: str
    messages: list[Turn]
    tools: list[Tool]


@dataclass(frozen=True)
class SessionView:
    """A session's public state."""

    session_id: str
    env: str
    task_id: str
    seed: int
    turn: int
    max_turns: int
    image: str
    idle_ttl_s: float


@dataclass(frozen=True)
class ToolAction:
    """Call a tool with JSON arguments (the text the policy produced)."""

    name: str
    arguments: str
    call_id: str = ""


@dataclass(frozen=True)
class FinalAnswer:
    """End the episode with this answer (like a completion without tool calls)."""

    text: str


Action = ToolAction | FinalAnswer


@dataclass(frozen=True)
class StepResult:
    """The outcome of one step. `status` is set on the last step only; `reward` is None when it failed."""

    observation: str
    reward: float | None
    terminated: bool
    truncated: bool
    status: RolloutStatus | None
    info: SessionView
    components: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    error: RolloutError | None = None


@dataclass
class _Session:
    id: str
    tenant: str
    env: Environment
    task: Task
    seed: int
    max_turns: int
    sandbox: Sandbox
    image: str
    state: EpisodeState
    reservation: Reservation | None = None
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    turn: int = 0
    ended: RolloutStatus | None = None
    released: bool = False  # its sandbox went back to the pool (once: a close and a step's end may both try)
    closed_after_end: bool = False  # dropped once its episode had ended (while its sandbox was being recycled)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0  # steps waiting for the one running (MAX_WAITING_STEPS)
    # the environment's own limit on the agent's time (Environment.episode_timeout_s), on time.monotonic(); None: none
    episode_end: float | None = None
    probe_at: float = field(default_factory=time.monotonic)  # its sandbox's next health check, between steps
    # the last step's turn (the session's turn when it began), its action's digest and its answer: the same Step sent
    # again at that turn, its answer lost, gets it again (a final step's reward among them) instead of running twice
    last: tuple[int, str, StepResult] | None = None
    died: StepResult | None = None  # its sandbox died between steps (end_dead): what the next Step answers


def _digest(action: Action) -> str:
    """An action's fingerprint: a Step sent again is the same action (its text is not kept with the answer)."""
    fields = (
        ("call", action.name, action.arguments, action.call_id)
        if isinstance(action, ToolAction)
        else ("answer", action.text)
    )
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


# Steps of one session that may wait behind the running one: a client that retries a step whose call it gave up on
# (the step runs to its end all the same) waits its turn; past it, a call is refused at once
MAX_WAITING_STEPS = 1


@dataclass(frozen=True)
class _Tombstone:
    tenant: str
    why: str
    at: float


def seed_for_task(task_id: str) -> int:
    """A stable seed for a task chosen by id."""
    return int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:4], "big")


class SessionManager:
    """Open sessions of every tenant. Start with `SessionManager.start(...)`; `close()` destroys them all."""

    def __init__(
        self,
        config: SessionConfig,
        registry: Registry,
        pool: SandboxPool,
        images: ImageSource,
        *,
        caps: SandboxCaps | None = None,
        admission: Scheduler | None = None,
    ) -> None:
        self.config = config
        self._registry = registry
        self._pool = pool
        self._images = images
        self._caps = caps or SandboxCaps()
        self._admission = admission  # None: sessions are not counted against the host's capacity
        self._sessions: dict[str, _Session] = {}
        self._reserved: dict[str, int] = {}
        self._ended: OrderedDict[str, _Tombstone] = OrderedDict()
        # each tenant's ended sessions still kept (to say how they ended), oldest first: at most max_per_tenant
        self._ended_of: dict[str, OrderedDict[str, None]] = {}
        self._reaper: asyncio.Task[None] | None = None

    @classmethod
    def start(
        cls,
        config: SessionConfig,
        registry: Registry,
        pool: SandboxPool,
        images: ImageSource,
        *,
        caps: SandboxCaps | None = None,
        admission: Scheduler | None = None,
    ) -> SessionManager:
        """A manager whose idle sessions expire in the background."""
        mgr = cls(config, registry, pool, images, caps=caps, admission=admission)
        mgr._reaper = asyncio.create_task(mgr._reap_forever(), name="session reaper")
        return mgr

    def _pick_task(self, env: Environment, task_id: str, seed: int | None) -> tuple[Task, int]:
        # looked up by id, read once per environment: a Reset copied and scanned the whole list (3.4 ms at 100,000
        # tasks, on the event loop)
        tasks, by_id = indexed_tasks(env)
        if task_id:
            task = by_id.get(task_id)
            if task is None:
                raise InvalidRequestError(f"task_id: {env.ref()} has no task {echo(task_id)}")
            return task, seed if seed is not None else seed_for_task(task_id)
        if not tasks:
            raise FailedPreconditionError(f"{env.ref()} has no tasks")
        seed = seed if seed is not None else secrets.randbits(31)
        return tasks[random.Random(seed).randrange(len(tasks))], seed

    async def reset(
        self, tenant: str, env_ref: str, task_id: str = "", seed: int | None = None, max_turns: int = 0
    ) -> tuple[SessionView, Observation]:
        """Open a session: a sandbox with the task set up. The task is `task_id`, or drawn with `seed`."""
        env = self._registry.get(env_ref, tenant)
        check_env_limits(env, self._caps)
        task, seed = self._pick_task(env, task_id, seed)
        if not 0 <= max_turns <= 1000:
            raise InvalidRequestError(f"max_turns must be between 1 and 1000 (0: the default), got {max_turns}")
        open_now = sum(s.tenant == tenant and s.ended is None for s in self._sessions.values())
        open_now += self._reserved.get(tenant, 0)
        if open_now >= self.config.max_per_tenant:
            raise BusyError(
                f"{open_now} sessions are open; sessions.max_per_tenant is {self.config.max_per_tenant}; close some"
            )
        try:
            # before the session opens: made after, an environment's failure here left a session open (its sandbox
            # and capacity held until its idle ttl) that the caller never heard of
            observation = self._observation(env, task)
        except Exception as e:
            raise FailedPreconditionError(
                f"{env.ref()}: the opening messages of task {task.id} could not be made: {type(e).__name__}: "
                f"{echo(str(e), 300)}"
            ) from e
        # the episode a scorer sees starts with the opening, as a job's rollout does (run_episode): without it a
        # rubric that read the prompt or counted turns scored a session's episode unlike the same one in a job
        state = EpisodeState.start(env)
        record_turns(state, observation.messages)
        if not state.fits():
            raise FailedPreconditionError(
                f"{env.ref()}: the opening messages of task {task.id} are over the episode's budget (EPISODE_BYTES)"
            )
        need = Need(cpus=env.limits.cpus, memory_mb=env.limits.memory_mb)
        reservation = self._admission.reserve(need, "a session", tenant) if self._admission is not None else None
        self._reserved[tenant] = self._reserved.get(tenant, 0) + 1
        try:
            # at most the environment's own, as a job's rollouts are (runner.py): a session asked for more
            turns = min(max_turns, env.max_turns) if max_turns else env.max_turns
            session = await self._open(tenant, env, task, seed, turns, state)
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        finally:
            self._reserved[tenant] -= 1
            if not self._reserved[tenant]:
                del self._reserved[tenant]
        session.reservation = reservation
        self._sessions[session.id] = session
        return self._view(session), observation

    async def _open(
        self, tenant: str, env: Environment, task: Task, seed: int, max_turns: int, state: EpisodeState
    ) -> _Session:
        sid = secrets.token_hex(12)
        image, _ = await self._images.resolve(env)
        last_step = self._step_budget(env, task)
        # as in the runner, the seed travels with the task (setup), so warm sandboxes stay interchangeable
        # a session may live max_lifetime_s, and the sweep removes a sandbox when its lease ends: a warm one must
        # have that much left, and a lease of twice that leaves a sandbox its first lifetime's worth of recycling
        sandbox, _ = await self._pool.acquire(
            SandboxSpec(
                image=image,
                limits=env.limits,
                runtime=env.runtime,
                env=dict(DETERMINISTIC_ENV),
                labels=pool_labels(tenant, env.workspace_seed),  # a warm pool of the tenant's own, and its seed's
                ttl_s=min(2 * (self.config.max_lifetime_s + last_step) + LEASE_GRACE_S, MAX_LEASE_S),
            ),
            need_s=self.config.max_lifetime_s + last_step,  # a step begun at the end of its lifetime runs on
        )
        try:
            await env_call(env.setup(sandbox, task, seed))
        except EnvironmentBroken as e:
            await self._pool.release(sandbox, recycle=False)
            raise FailedPreconditionError(f"{env.ref()}: setting up task {task.id} failed: {e}") from e
        except BaseException:
            await asyncio.shield(self._pool.release(sandbox, recycle=False))
            raise
        session = _Session(sid, tenant, env, task, seed, max_turns, sandbox, image, state)
        if own := episode_budget(env, task):  # the agent's time, from the end of the setup, as a rollout's
            session.episode_end = time.monotonic() + own
        return session

    @staticmethod
    def _observation(env: Environment, task: Task) -> Observation:
        messages = opening_turns(env.messages(task))
        return Observation(task.prompt, messages, get_tools(env.tools))

    def _view(self, s: _Session) -> SessionView:
        return SessionView(s.id, s.env.ref(), s.task.id, s.seed, s.turn, s.max_turns, s.image, self.config.idle_ttl_s)

    def _expired_why(self, s: _Session, now: float) -> str:
        if now - s.last_used > self.config.idle_ttl_s:
            return f"expired after {self.config.idle_ttl_s:g}s idle (its sandbox was destroyed); call Reset again"
        if now - s.created > self.config.max_lifetime_s:
            return f"expired: it reached the maximum session lifetime of {self.config.max_lifetime_s:g}s"
        return ""

    async def _get(self, tenant: str, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is not None and s.tenant == tenant:
            why = "" if s.lock.locked() else self._expired_why(s, time.monotonic())
            if not why:
                return s
            await self._drop(s, why)
        tomb = self._ended.get(session_id)
        if tomb is not None and tomb.tenant == tenant:
            raise NotFoundError(f"session {session_id} {tomb.why}")
        raise NotFoundError(f"no session {echo(session_id)}")

    async def _drop(self, s: _Session, why: str) -> None:
        """Forget a session, leaving a tombstone that tells its owner why."""
        if self._sessions.pop(s.id, None) is None:
            return
        ended = self._ended_of.get(s.tenant)
        if ended is not None:
            ended.pop(s.id, None)
            if not ended:
                del self._ended_of[s.tenant]
        self._ended[s.id] = _Tombstone(s.tenant, why, time.monotonic())
        while len(self._ended) > MAX_TOMBSTONES:
            self._ended.popitem(last=False)
        s.closed_after_end = s.ended is not None
        if s.ended is None:
            await self._release(s, recycle=False)

    async def _release(self, s: _Session, recycle: bool) -> None:
        """Hand the sandbox back: recycled when the environment allows it and nothing failed, else destroyed."""
        if s.released:
            return
        s.released = True
        if s.reservation is not None:
            s.reservation.release()
        try:
            await asyncio.shield(
                self._pool.release(s.sandbox, recycle=recycle and s.env.reusable, workspace_seed=s.env.workspace_seed)
            )
        except SandboxError:
            log.warning("could not release the sandbox of session %s", s.id, exc_info=True)

    async def step(self, tenant: str, session_id: str, action: Action, turn: int | None = None) -> StepResult:
        """Apply one action; the step that ends the episode scores it and releases the sandbox. A step whose call is
        cancelled (a client's deadline) runs to its end all the same: cut midway, the transcript kept the assistant's
        call without its tool turn (the next step reused its id), and a step cut while scoring scored again. `turn`:
        the session's turn the action is for; the step taken at it already is answered again (StepRequest.turn)."""
        s = await self._get(tenant, session_id)
        if s.lock.locked() and s.waiting >= MAX_WAITING_STEPS:
            # each waiting call holds its request (up to the server's message size) for as long as the steps before
            # it take: a hundred Steps sent at once to one session held gigabytes for minutes
            raise FailedPreconditionError(
                f"session {session_id} has a step running and {s.waiting} waiting: a session's steps run one at a "
                "time, each on the observation of the one before; wait for its answer"
            )
        # its turn behind the step before it is waited for in the call: a call that gives up meanwhile took no step
        # (waited for in the work run to its end, a step cut while queued ran later all the same, an action the
        # client never saw the outcome of, and ran again when it retried)
        s.waiting += 1
        try:
            await s.lock.acquire()
        finally:
            s.waiting -= 1
        return await run_to_end(self._step_locked(s, session_id, action, turn))

    async def _step_locked(self, s: _Session, session_id: str, action: Action, turn: int | None) -> StepResult:
        """The step, with the session's lock held by the caller; it lets go at the end."""
        try:
            self._check_open(s)  # closed or expired while this step waited for the one before it
            if s.died is not None:  # as a step that found the sandbox dead would have ended: INFRA_ERROR
                return s.died
            if turn is not None:
                if s.last is not None and s.last[0] == turn:
                    if s.last[1] != _digest(action):  # two clients on one session, or a stale turn: not a resend
                        raise FailedPreconditionError(
                            f"session {session_id} took another action at turn {turn}: send the turn of the last "
                            "answer's info"
                        )
                    return s.last[2]  # taken already, its answer lost on the way: the same answer, no second action
                if turn != s.turn:
                    raise FailedPreconditionError(
                        f"session {session_id} is at turn {s.turn}, not {turn}: send the turn of the last answer's "
                        "info (Reset's for the first step)"
                    )
            # past its lifetime while its steps came one behind the other: the checks that skip a session in a step
            # never got to it, and it lived until the sweep took its sandbox mid-step (an infrastructure failure)
            if s.ended is None and (why := self._expired_why(s, time.monotonic())):
                await self._drop(s, why)
                raise NotFoundError(f"session {session_id} {why}")
            if s.ended is not None:
                raise FailedPreconditionError(
                    f"session {session_id} has ended ({s.ended.value}); call Reset for a new episode"
                )
            s.last_used = time.monotonic()
            began = s.turn
            try:
                result = await self._step(s, action)
            finally:
                s.last_used = time.monotonic()
            s.last = (began, _digest(action), result)
            if not s.closed_after_end:
                # closed during the step: its sandbox went midway, so neither a reward nor a failure. Closed once the
                # step had ended the episode (its sandbox being recycled), the step's outcome stands: a scored
                # reward was thrown away, and the close and the step each said the other had ended it
                self._check_open(s)
            return result
        finally:
            s.lock.release()

    def _check_open(self, s: _Session) -> None:
        if self._sessions.get(s.id) is not s:
            tomb = self._ended.get(s.id)
            raise NotFoundError(f"session {s.id} {tomb.why if tomb is not None else 'was closed'}")

    def _step_budget(self, env: Environment, task: Task) -> float:
        """A step's time: its tool call, then the scoring of a final one (at least the grader's own timeouts)."""
        return env.tool_timeout_s + max(self.config.scoring_budget_s, scoring_budget(env, task))

    async def _step(self, s: _Session, action: Action) -> StepResult:
        observation = ""
        finish: Finish | None = None
        try:
            # a final step's grader gets its own timeouts' worth (Environment.scoring_timeout_s), at least
            async with asyncio.timeout(self._step_budget(s.env, s.task)):
                if isinstance(action, ToolAction):
                    fits = s.state.fits(action.arguments, action.name, action.call_id, calls=1)
                else:
                    fits = s.state.fits(action.text)
                left = math.inf if s.episode_end is None else s.episode_end - time.monotonic()
                taken = False
                if not fits:
                    finish = "length"  # the episode is as long as it may be (EPISODE_BYTES): TRUNCATED without it
                elif left <= 0:
                    finish = "time"  # past the agent's time (the client's own generation counts): scored as it is
                elif isinstance(action, ToolAction):
                    call = ToolCallRecord(
                        id=action.call_id or f"call-{s.turn}", name=action.name, arguments=action.arguments
                    )
                    record_assistant(s.state, "", [call])
                    t0 = time.monotonic()
                    taken = True
                    # stopped at the agent's time, as a rollout's tool call is (TRUNCATED, and scored)
                    timeout_s = min(s.env.tool_timeout_s, left)
                    try:
                        observation = (await run_tool_call(s.env, s.sandbox, s.state, call, timeout_s)).output
                    finally:  # as a job's tool calls are: the one that failed too
                        self._pool.metrics.exec_seconds.observe(time.monotonic() - t0)
                    if s.state.submitted:
                        finish = "submit"
                    elif s.episode_end is not None and time.monotonic() >= s.episode_end:
                        finish = "time"
                else:
                    record_assistant(s.state, action.text, [])
                    finish, s.state.answer = "stop", action.text
                if finish not in ("length", "time") or taken:  # a step not taken is no turn
                    s.turn += 1
                if finish is None and s.turn >= s.max_turns:
                    finish = "max_turns"
                if finish is None:
                    return StepResult(observation, 0.0, False, False, None, self._view(s))
                score = await env_score(s.env, s.sandbox, s.task, s.state.episode(finish))
        except Exception as e:
            return await self._fail(s, observation, e)
        status = finished_status(finish)
        await self._end(s, status, recycle=True)
        return StepResult(
            observation,
            score.reward,
            terminated=status == RolloutStatus.OK,
            truncated=status == RolloutStatus.TRUNCATED,
            status=status,
            info=self._view(s),
            components=dict(score.components),
            metrics={**score.metrics, "tool_calls": float(s.state.tool_calls)},
        )

    async def _end(self, s: _Session, status: RolloutStatus, recycle: bool = False) -> None:
        s.ended = status
        # an ended session stays to say how it ended until it is closed or idles out; its transcript (up to
        # EPISODE_BYTES) goes now: kept, a tenant's loop of Reset and a long last Step held memory without bound,
        # since only the sessions still open count against sessions.max_per_tenant
        s.state.turns.clear()
        s.state.answer = None
        await self._release(s, recycle)
        # and so do the tenant's ended sessions past max_per_tenant, the oldest first, each to a tombstone (capped):
        # kept, a loop of Reset and a last Step held one a Reset, its environment, task and state, for idle_ttl_s
        ended = self._ended_of.setdefault(s.tenant, OrderedDict())
        ended[s.id] = None
        while len(ended) > self.config.max_per_tenant:
            old = self._sessions.get(next(iter(ended)))
            if old is None or old.ended is None:  # not kept, or not ended: nothing to say of it here
                ended.popitem(last=False)
                continue
            await self._drop(old, f"has ended ({old.ended.value}); call Reset for a new episode")

    async def _fail(self, s: _Session, observation: str, e: BaseException) -> StepResult:
        status, error = classify_failure(e, timeout_message="the step exceeded its time budget")
        log.info("session %s ended with %s: %s", s.id, status.value, error.message)
        await self._end(s, status)
        return StepResult(
            observation, None, terminated=False, truncated=True, status=status, info=self._view(s), error=error
        )

    async def close(self, tenant: str, session_id: str) -> bool:
        """Destroy the session's sandbox; returns whether the episode was still running."""
        s = await self._get(tenant, session_id)
        running = s.ended is None
        await self._drop(s, "was closed")
        return running

    def open_sessions(self, tenant: str | None = None) -> int:
        """How many sessions hold a sandbox now (of one tenant, or of all)."""
        return sum(s.ended is None and tenant in (None, s.tenant) for s in self._sessions.values())

    async def _reap_forever(self) -> None:
        interval = min(max(self.config.idle_ttl_s / 4, 0.2), 5.0, self.config.probe_interval_s)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap()
                await self.end_dead()
            except Exception:
                log.exception("session reaper failed")

    async def end_dead(self) -> int:
        """Health-check the sandboxes of open sessions between steps (each every probe_interval_s) and end those
        whose container died, INFRA_ERROR, as the next step would have found it (that step answers so: the clients'
        failure handling is the same whether the check or the step found it first), their capacity and the tenant's
        slot back now, not at the idle expiry. Returns how many."""
        now = time.monotonic()
        due = [s for s in self._sessions.values() if s.ended is None and not s.lock.locked() and now >= s.probe_at]
        for s in due:
            s.probe_at = now + self.config.probe_interval_s
        verdicts = await each_checked(due, lambda s: died(s.sandbox, s.id), lambda s: f"session {s.id}")
        ended = 0
        for s, why in zip(due, verdicts, strict=True):
            # a step that began meanwhile finds the sandbox dead itself, and says so as its outcome
            if why is None or self._sessions.get(s.id) is not s or s.ended is not None or s.lock.locked():
                continue
            log.warning("session %s of %s: its sandbox died (%s); ending it", s.id, s.tenant, why)
            error = RolloutError(kind="SandboxDiedError", message=f"the sandbox died between steps: {why}")
            # said before the first await: a Step that takes the lock meanwhile answers it, never runs on the dead
            s.died = StepResult("", None, False, True, RolloutStatus.INFRA_ERROR, self._view(s), error=error)
            try:
                await self._end(s, RolloutStatus.INFRA_ERROR)
            except Exception:
                log.exception("ending session %s failed", s.id)
            ended += 1
        return ended

    async def reap(self) -> int:
        """Expire idle sessions now; returns how many."""
        now = time.monotonic()
        doomed = [
            (s, why)
            for s in list(self._sessions.values())
            if not s.lock.locked() and (why := self._expired_why(s, now))
        ]
        for s, why in doomed:
            log.info("session %s of %s %s", s.id, s.tenant, why)
            await self._drop(s, why)
        while self._ended and now - next(iter(self._ended.values())).at > TOMBSTONE_KEEP_S:
            self._ended.popitem(last=False)
        return len(doomed)

    async def close_all(self) -> None:
        """Stop expiring and destroy every session's sandbox."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        sessions, self._sessions, self._ended_of = list(self._sessions.values()), {}, {}
        # through _release, which marks each released: a step still running releases nothing again (its sandbox
        # went back to the pool twice, and the pool's counts drifted)
        await asyncio.gather(*(self._release(s, recycle=False) for s in sessions), return_exceptions=True)
