"""One rollout from work item to scored Rollout: acquire a sandbox, set the task up, run the agent loop, score,
release. Infrastructure failures are retried on a fresh sandbox; no failure is ever reported as a reward."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from orchestrator.backends.pool import SandboxPool, lease_for, pool_labels
from orchestrator.core.environment import Environment, ImageSource, Task, episode_budget, scoring_budget
from orchestrator.core.errors import (
    BuildRoomError,
    ConfigError,
    EnvironmentBroken,
    ImageBuildError,
    ImageNotOnHostError,
    SandboxError,
    SandboxWaitTimeoutError,
)
from orchestrator.core.log_limit import LogLimit
from orchestrator.core.models import (
    EncodedRollout,
    JobSpec,
    Provenance,
    Rollout,
    RolloutError,
    RolloutStatus,
    Timing,
    Tokens,
    Turn,
    rollout_id,
)
from orchestrator.core.policy import REPLAY_URL
from orchestrator.core.sandbox import DETERMINISTIC_ENV, Sandbox, SandboxSpec, keeps_time
from orchestrator.core.tracing import (
    ATTEMPT,
    ATTEMPTS,
    ENV,
    JOB_ID,
    NOOP_TRACER,
    REWARD,
    ROLLOUT_ID,
    SAMPLE_INDEX,
    SANDBOX_WARM,
    STATUS,
    TASK_ID,
    Attributes,
    AttributeValue,
    Phase,
    Span,
    Tracer,
)
from orchestrator.rollout.episode import run_episode
from orchestrator.rollout.policy.base import Policy
from orchestrator.rollout.policy.http import Waits
from orchestrator.rollout.snapshots import SnapshotCache
from orchestrator.rollout.step import classify_failure, env_call, env_score, finished_status

log = logging.getLogger(__name__)
R = TypeVar("R", Rollout, EncodedRollout, Rollout | EncodedRollout)  # a model, or a worker's encoded rollout
RETRY_BACKOFF_CAP_S = 8.0  # the longest pause between infrastructure retries of one rollout
SCORING_RESERVE_MAX_S = 300.0  # the most of a rollout's time kept for its scoring (scoring_reserve)


@dataclass(frozen=True)
class WorkItem:
    """One sample of one task of one job."""

    job_id: str
    task: Task
    sample_index: int
    enqueued_at: float
    tenant: str = ""  # the job's owner: its sandboxes come from a warm pool of that tenant's own ("": shared)
    traceparent: str = ""  # the rollout's span upstream (W3C), when it is traced

    # made once: the control plane reads each several times a rollout (placement, the log, the stream)
    @functools.cached_property
    def id(self) -> str:
        return rollout_id(self.job_id, self.task.id, self.sample_index)

    @functools.cached_property
    def group_id(self) -> str:
        return f"{self.job_id}:{self.task.id}"

    @property
    def seed(self) -> int:
        return int.from_bytes(hashlib.sha256(self.id.encode()).digest()[:4], "big")


def attempt_s(spec: JobSpec, grading_s: float) -> float:
    """The longest one attempt runs: the fleet's part (the image, a sandbox, the environment's setup) within the
    rollout's time, then the rollout's time again for the episode and its scoring, a grader's own timeouts past it
    (scoring_budget), and what it may wait out of its policy server down (PolicyEndpoint.outage_wait_s), which moves
    its end on (the replay policy has no server)."""
    outage_s = 0.0 if spec.policy.base_url == REPLAY_URL else spec.policy.outage_wait_s
    return 2 * spec.rollout_timeout_s + grading_s + outage_s


def _later(deadline: asyncio.Timeout, seconds: float) -> float | None:
    """`deadline`'s time moved on by `seconds` (None, no deadline, stays so)."""
    when = deadline.when()
    return None if when is None else when + seconds


def left_retries(spec: JobSpec, spent: int) -> int:
    """The infrastructure retries a rollout has left after `spent` attempts elsewhere (on workers that were lost)."""
    return max(0, spec.max_infra_retries - spent)


def scoring_reserve(spec: JobSpec) -> float:
    """What of a rollout's time its scoring keeps: the episode's tool calls end (TRUNCATED, "time") when only this is
    left, so that a policy that spends its time in them is still scored rather than a masked TIMEOUT. A quarter of
    the rollout's time, at most SCORING_RESERVE_MAX_S."""
    return min(spec.rollout_timeout_s / 4, SCORING_RESERVE_MAX_S)


def unrun_rollout(item: WorkItem, env_ref: str, policy_version: str, error: RolloutError, attempts: int = 1) -> Rollout:
    """The INFRA_ERROR rollout of an item nothing could run to an end (its workers lost, its executor failed):
    delivered so the trainer can mask it, never scored."""
    return Rollout(
        id=item.id,
        job_id=item.job_id,
        env=env_ref,
        task_id=item.task.id,
        group_id=item.group_id,
        sample_index=item.sample_index,
        policy_version=policy_version,
        status=RolloutStatus.INFRA_ERROR,
        error=error,
        attempts=attempts,
    )


def rollout_attributes(item: WorkItem, env_ref: str) -> Attributes:
    """What identifies a rollout on its trace's root span."""
    return {
        ROLLOUT_ID: item.id,
        JOB_ID: item.job_id,
        ENV: env_ref,
        TASK_ID: item.task.id,
        SAMPLE_INDEX: item.sample_index,
    }


async def traced_rollout(tracer: Tracer, item: WorkItem, env_ref: str, run: Callable[[WorkItem], Awaitable[R]]) -> R:
    """`run(item)` under the rollout's root span, from the item's enqueueing to its end; the item `run` gets carries
    the span's traceparent, so the runner's spans (here or in a worker process) are its children."""
    if not tracer.enabled:
        return await run(item)
    root = tracer.start("rollout", item.enqueued_at, rollout_attributes(item, env_ref))
    try:
        rollout = await run(dataclasses.replace(item, traceparent=root.traceparent))
    except BaseException as e:
        root.end(time.monotonic(), e)
        raise
    outcome: dict[str, AttributeValue] = {STATUS: rollout.status.value, ATTEMPTS: rollout.attempts}
    if rollout.reward is not None:
        outcome[REWARD] = rollout.reward
    root.set(outcome)
    root.end(time.monotonic())
    return rollout


async def _setup_overran(sandbox: Sandbox, env: Environment, spec: JobSpec) -> Exception:
    """What a setup the rollout's deadline cut is: the host's (INFRA_ERROR, retried) where the sandbox does not keep
    time, else the environment's (ENV_ERROR): a setup that hangs, or takes longer than the job gives a rollout. It
    was TIMEOUT, the episode's outcome, before any episode began."""
    what = f"the environment's setup did not end within the rollout's {spec.rollout_timeout_s:g}s"
    try:
        await keeps_time(sandbox, what)
    except SandboxError as slow:
        return slow
    return EnvironmentBroken(f"{what}, on a sandbox that keeps time: {env.ref()}'s setup is stuck or slower than that")


class RolloutRunner:
    """Runs work items on a sandbox backend, tracing each (no-op unless a tracer is given)."""

    def __init__(
        self,
        sandboxes: SandboxPool,
        images: ImageSource,
        tracer: Tracer = NOOP_TRACER,
        snapshots: SnapshotCache | None = None,
    ) -> None:
        self.sandboxes = sandboxes
        self.images = images
        self.tracer = tracer
        self.active: dict[str, Sandbox] = {}  # rollout id -> its sandbox, while it runs
        self.engine_waits: set[str] = set()  # ids of the rollouts waiting for their engine to answer again
        self.snapshots = SnapshotCache() if snapshots is None else snapshots
        self._retries_said = LogLimit()  # a broken engine fails every rollout: a line a minute for each kind of failure

    async def run(
        self, item: WorkItem, env: Environment, spec: JobSpec, policy: Policy, policy_version: str
    ) -> Rollout:
        """A scored (or failed) rollout; INFRA_ERROR attempts are retried up to the job's budget."""
        if self.tracer.enabled and not item.traceparent:  # nobody upstream traces it: its trace starts here
            return await traced_rollout(
                self.tracer, item, env.ref(), lambda i: self._run(i, env, spec, policy, policy_version)
            )
        return await self._run(item, env, spec, policy, policy_version)

    async def _run(
        self, item: WorkItem, env: Environment, spec: JobSpec, policy: Policy, policy_version: str
    ) -> Rollout:
        started = time.monotonic()
        started_at = time.time()
        parent = self.tracer.remote(item.traceparent)
        # the same two readings are the timing's queue (each attempt's Timing) and the queue span
        parent.open("queue", item.enqueued_at).end(started)
        attempt = 0
        backend = self.sandboxes.backend
        # an engine found not answering (a dockerd restarting) is waited for before each retry, rather than
        # spending the rollout's retries on it: past the engine call limiter's pauses, the rollouts a worker started
        # meanwhile were INFRA_ERRORs, masked samples, and the job's queue drained into them. Not before a first
        # attempt: a warm sandbox needs no engine, and served rollouts through the outage
        engine_wait_left = backend.outage_wait_s
        engine_waited = 0.0
        while True:
            attempt += 1
            if attempt > 1 and engine_wait_left > 0:
                self.engine_waits.add(item.id)  # a rollout worker says so: another host may take it meanwhile
                try:
                    waited = await backend.wait_answering(engine_wait_left)
                finally:
                    self.engine_waits.discard(item.id)
                engine_wait_left -= waited
                engine_waited += waited
            rollout = await self._attempt(item, env, spec, policy, policy_version, started, parent, attempt)
            rollout.attempts = attempt
            if rollout.reward is not None:
                rollout.metrics["engine_outage_s"] = engine_waited  # waited for the engine (engine_outage_wait_s)
            # wall-clock bounds for the trainer: from the first attempt's start to the last attempt's end, the end
            # counted on the monotonic clock (a wall clock set back between the two made it end before it began)
            rollout.started_at, rollout.finished_at = started_at, started_at + (time.monotonic() - started)
            if rollout.status != RolloutStatus.INFRA_ERROR or attempt > spec.max_infra_retries:
                return rollout
            await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), RETRY_BACKOFF_CAP_S))  # the engine recovers
            kind = rollout.error.kind if rollout.error else ""
            if (more := self._retries_said.allow(kind)) is not None:
                log.warning(
                    "rollout %s: infrastructure error (attempt %d), retrying on a fresh sandbox: %s%s",
                    item.id,
                    attempt,
                    rollout.error.message if rollout.error else "",
                    more,
                )

    async def _attempt(
        self,
        item: WorkItem,
        env: Environment,
        spec: JobSpec,
        policy: Policy,
        policy_version: str,
        started: float,
        parent: Span,
        attempt: int,
    ) -> Rollout:
        timing = Timing(queue=started - item.enqueued_at)
        turns: list[Turn] = []
        tokens = Tokens()
        prov = Provenance(
            env_version=env.version, seed=item.seed, policy_model=spec.policy.model, policy_version=policy_version
        )
        base = {
            "id": item.id,
            "job_id": item.job_id,
            "env": env.ref(),
            "task_id": item.task.id,
            "group_id": item.group_id,
            "sample_index": item.sample_index,
            "policy_version": policy_version,
        }
        t_start = time.monotonic()
        loop = asyncio.get_running_loop()
        span = parent.open("attempt", t_start, {ROLLOUT_ID: item.id, JOB_ID: item.job_id, ATTEMPT: attempt})
        grading_s = scoring_budget(env, item.task)
        episode_s = episode_budget(env, item.task)
        sandbox = None
        warm = False
        failure: Exception | None = None
        infra_failed = False
        fleet_part = "acquire"  # the fleet's part, "acquire" then "setup", until the episode starts ("")
        setup_kind = "own"
        try:
            try:
                async with asyncio.timeout(spec.rollout_timeout_s) as deadline:
                    # each phase is measured once: its seconds go into the timing, its readings make its span
                    with Phase(span, "acquire") as phase:
                        try:
                            image, image_id = await self.images.resolve(env)
                        except (ImageNotOnHostError, BuildRoomError) as e:  # this host's lack: INFRA_ERROR
                            raise ConfigError(f"this host cannot build the image of {env.ref()}: {e}") from e
                        except ImageBuildError as e:
                            raise EnvironmentBroken(f"image for {env.ref()} could not be built: {e}") from e
                        prov.image, prov.image_id = image, image_id
                        # the seed travels with the task (setup), not in the sandbox's environment, so sandboxes
                        # stay interchangeable in the warm pool
                        labels = pool_labels(item.tenant, env.workspace_seed)
                        # the sandbox's lease must outlast the attempt: the sweep removes it at the end, in use or
                        # not (a warm one's lease runs from its creation, so the pool checks what is left)
                        sandbox, source = await self.sandboxes.acquire(
                            SandboxSpec(
                                image=image,
                                limits=env.limits,
                                runtime=env.runtime,
                                env=dict(DETERMINISTIC_ENV),
                                labels=labels,
                                ttl_s=lease_for(attempt_s(spec, grading_s)),
                            ),
                            need_s=attempt_s(spec, grading_s),
                        )
                        warm = source == "warm"
                        self.active[item.id] = sandbox
                        phase.span.set({SANDBOX_WARM: warm})
                    fleet_part = "setup"
                    timing.sandbox_acquire = phase.seconds
                    with Phase(span, "setup") as phase:
                        box = sandbox
                        if env.snapshot_setup and spec.group_size > 1:
                            setup_kind = await self.snapshots.prepare(
                                (item.job_id, item.task.id),
                                box,
                                box.spec.workspace,
                                lambda: env_call(env.setup(box, item.task, item.seed)),
                                restores=spec.group_size - 1,
                                sample=item.sample_index,
                            )
                        else:
                            await env_call(env.setup(box, item.task, item.seed))
                            setup_kind = "own"
                    timing.setup = phase.seconds
                    fleet_part = ""  # what runs out of time from here is the episode's
                    # the rollout's time is the episode's and its scoring's, counted from here: the fleet's part
                    # (the image, a sandbox, the environment's setup) had a limit of its own. Counted from the
                    # attempt's start, a slow sandbox shortened the policy's time, and the episode it cut short was
                    # scored (a TRUNCATED 0 for the fleet's slowness), beside samples of its group that had it all
                    episode_start = loop.time()
                    deadline.reschedule(episode_start + spec.rollout_timeout_s)
                    # the episode's share: scoring keeps the rest, whatever the policy spent; an environment's
                    # own limit on the agent's time (Harbor's [agent] timeout_sec) ends it sooner the same way
                    rollout_episode_end = episode_start + spec.rollout_timeout_s - scoring_reserve(spec)
                    episode_deadline = min(rollout_episode_end, episode_start + (episode_s or math.inf))
                    # a wait for the policy server down is none of the rollout's time: its end moves on too
                    waits = Waits(spec.policy.outage_wait_s, lambda s: deadline.reschedule(_later(deadline, s)))
                    with Phase(span, "episode") as phase:
                        result = await run_episode(
                            env,
                            item.task,
                            sandbox,
                            policy,
                            spec.sampling,
                            min(spec.max_turns, env.max_turns) if spec.max_turns else env.max_turns,
                            item.id,
                            turns,
                            spec.max_model_len if spec.token_mode == "tito" else None,
                            span=phase.span,
                            tool_seconds=self.sandboxes.metrics.exec_seconds.observe,
                            deadline=episode_deadline,
                            # a generation the server's failures delayed is cut by half the scoring's reserve at the
                            # latest, its turn lost but the rollout scored: past the rollout's end it was TIMEOUT
                            cut_by=rollout_episode_end + scoring_reserve(spec) / 2,
                            waits=waits,
                        )
                    tokens = result.tokens.result()
                    timing.generation, timing.tools = result.generation_s, result.tools_s
                    prov.policy_model = result.policy_model or spec.policy.model
                    with Phase(span, "scoring") as phase:
                        # the grader's own timeouts decide what a grader that runs long scores, not what is left
                        deadline.reschedule(max(deadline.when() or 0.0, loop.time() + grading_s))
                        score = await env_score(env, sandbox, item.task, result.episode)
                        if score.reward is not None:
                            phase.span.set({REWARD: score.reward})
                    timing.scoring = phase.seconds
            except Exception as e:
                if type(e) is TimeoutError and fleet_part == "acquire":  # the attempt's deadline, the fleet's part
                    e = SandboxWaitTimeoutError(
                        f"no sandbox within the rollout's {spec.rollout_timeout_s:g}s (waiting for the image, a "
                        "place to start one, or the engine)"
                    )
                elif type(e) is TimeoutError and fleet_part == "setup" and sandbox is not None:
                    e = await _setup_overran(sandbox, env, spec)
                failure = e
                # a sandbox that failed us (or any failure nobody classified) is never reused
                status, error = classify_failure(e, timeout_message=f"rollout exceeded {spec.rollout_timeout_s:g}s")
                infra_failed = status == RolloutStatus.INFRA_ERROR
            finally:
                self.active.pop(item.id, None)
                if sandbox is not None:
                    with Phase(span, "release"):
                        await self._release(sandbox, env, recycle=env.reusable and not infra_failed, item=item)
        except BaseException as e:  # cancelled (CancelJob, shutdown)
            span.end(time.monotonic(), e)
            raise
        t_end = time.monotonic()
        timing.total = t_end - t_start
        if failure is not None:
            rollout = Rollout(
                **base, status=status, turns=turns, tokens=tokens, timing=timing, provenance=prov, error=error
            )
        else:
            rollout = Rollout(
                **base,
                status=finished_status(result.episode.finish),
                reward=score.reward,
                reward_components=score.components,
                metrics={
                    **score.metrics,
                    "tool_calls": float(result.episode.tool_calls),
                    "sandbox_warm": float(warm),
                    "setup_from_snapshot": float(setup_kind == "restored"),
                    "policy_outage_s": waits.waited,  # waited out for the policy server down (outage_wait_s)
                },
                turns=turns,
                tokens=tokens,
                timing=timing,
                provenance=prov,
            )
        span.set({STATUS: rollout.status.value})
        span.end(t_end, failure)
        return rollout

    async def _release(self, sandbox: Sandbox, env: Environment, *, recycle: bool, item: WorkItem) -> None:
        """A finished rollout hands the sandbox to background destruction (or recycles it); a cancelled one
        (CancelJob) waits until it is gone, so cancelling stops the job's sandboxes before it returns."""
        task = asyncio.current_task()
        cancelled = task is not None and task.cancelling() > 0
        try:
            if cancelled:
                await asyncio.shield(self.sandboxes.close_now(sandbox))
            else:
                # a sandbox that failed us is never reused; a reusable one is reset in place when it can be
                await asyncio.shield(
                    self.sandboxes.release(sandbox, recycle=recycle, workspace_seed=env.workspace_seed)
                )
        except Exception:
            log.exception("could not destroy sandbox of %s", item.id)
