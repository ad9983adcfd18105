"""Jobs: submit, run through the scheduler, log every scored rollout, stream with acks and backpressure, resume
after a restart.

A new job's rollouts start once no submit has been in progress for START_QUIET_S (or START_DEFER_S after it was
accepted, whichever comes first): on one host the rollouts share the cores with the API, and a burst of submits is
answered before the work it brings starts. The quiet spell matters: in a burst from one client the server often
answers every call it has before the next arrives, and starting the jobs at each such moment put a fifth of a burst's
rollouts between its submits. A rollout waits at most a fraction of a second for it.

Caps (RESOURCE_EXHAUSTED, naming the cap): unfinished jobs per tenant, rollouts per job, the sandbox limits of the
job's environment, open streams per tenant. A tenant may submit jobs only on environments it can see (public ones
and its own private ones).

Retention: a finished job is kept `retention_s` after its end (on the monotonic clock while this process runs; the
wall clock spans a restart), and while a stream of it is open, then removed from memory and from the result log, so
that a control plane that runs for weeks holds, lists and resumes only its recent jobs and its log stops growing once
it holds that window. A tenant keeps at most caps.finished_jobs_per_tenant finished jobs within that window; past it
its oldest go early. A job's counts live in memory: GetJob and ListJobs read no log."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import Counter as MetricCounter

from orchestrator.core.echo import echo, echo_list, error_text
from orchestrator.core.environment import Environment, Task
from orchestrator.core.errors import (
    BusyError,
    EnvfleetError,
    EnvironmentNotFoundError,
    InvalidRequestError,
    JobFinishedError,
    JobNotFoundError,
    QuotaExceededError,
)
from orchestrator.core.log_limit import LogLimit
from orchestrator.core.metrics import Metrics
from orchestrator.core.models import (
    AdvantageMode,
    JobCounts,
    JobInfo,
    JobSpec,
    JobState,
    RolloutError,
    RolloutStatus,
)
from orchestrator.core.policy import origin, shown_url
from orchestrator.core.runtime import run_to_end
from orchestrator.core.tracing import NOOP_TRACER, Tracer
from orchestrator.rollout.runner import WorkItem, traced_rollout, unrun_rollout
from orchestrator.service.advantages import group_advantages
from orchestrator.service.caps import CapsConfig, TenantCounter, check_env_limits
from orchestrator.service.executor import Executor
from orchestrator.service.registry import Registry
from orchestrator.service.scheduler import Capacity, Need, PendingItems, Scheduler
from orchestrator.service.store import LogEntry, ResultStore
from orchestrator.service.tenancy import LOCAL_TENANT

log = logging.getLogger(__name__)

MAX_ROLLOUTS_PER_JOB = 1_000_000
START_DEFER_S = 0.25  # the longest a new job's rollouts wait for the submits in progress to be answered
START_QUIET_S = 0.01  # how long no submit must be in progress before the new jobs' rollouts start
EXPIRY_EVERY_MAX_S = 60.0  # how often finished jobs are checked against the retention, at most
LOG_RETRY_FIRST_S, LOG_RETRY_MAX_S = 0.1, 5.0  # a result log write that failed is tried again, backing off
# while results come quicker than this, a stream sends at most one batch per gap, carrying all that landed meanwhile
STREAM_GAP_S = 0.05
# the most bytes of rollouts one stream message carries (more than one rollout or group never goes past it): under
# gRPC's default 4 MiB receive limit, which a trainer in most languages has unless it raises it, and under the
# server's smallest max_message_bytes, with room for the fields the stream adds (seq, advantage, group headers)
STREAM_BATCH_BYTES = 3 << 20
FINISHED_STATES = (JobState.COMPLETED, JobState.CANCELLED)
T = TypeVar("T")


@dataclass
class Group:
    """A whole group of samples of one task, with the advantages of the scored ones (the job's `advantage` mode)."""

    group_id: str
    task_id: str
    entries: list[LogEntry]
    advantages: list[float | None]
    failed: int
    more: bool = False  # a part of a group over STREAM_BATCH_BYTES, with more of it in the next message


@dataclass
class Batch:
    """What one stream message carries: log entries (rollouts as stored), or whole groups of them.

    Entries stay in their stored JSON form: the wire edge turns them straight into messages, which keeps the
    stream fast; `LogEntry.rollout()` gives the model when one is needed.
    """

    entries: list[LogEntry] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)


@dataclass
class _Listener:
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    outstanding: set[int] = field(default_factory=set)
    full: bool = False  # waiting for acks (its window is full), not for results
    # while it reads the log: what acks took meanwhile. The rows it read may be among them (a resume behind an ack
    # in flight, another stream of the job), and counted as sent after, they held its window for good
    acked_in_read: set[int] | None = None


@dataclass
class _Job:
    job_id: str
    spec: JobSpec
    env: Environment | None  # None: resumed after its environment was unregistered (ended; nothing of it runs)
    total: int
    state: JobState
    created_at: float
    done: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    listeners: list[_Listener] = field(default_factory=list)
    owner: str = LOCAL_TENANT  # the tenant that submitted it; other tenants see no such job
    delivered: int = 0  # the highest seq sent on any stream: Ack refuses an up_to beyond it
    finished_at: float | None = None
    # when it ended on this process's monotonic clock, which retention and the finished-jobs cap read: on the wall
    # clock, one set an hour on removed every finished job at the next expiry round, acked or not
    ended_mono: float | None = None
    acked: int = 0  # rollouts acked so far (with done and by_status, what GetJob reports without reading the log)
    stored_bytes: int = 0  # what its rollouts hold in the result log (caps.result_bytes_per_tenant)
    # of a finished job delivered in groups, its rollouts a stream can send (a group never whole is not); None: done
    published: int | None = None
    # why the server ended it, which its streams end with once all it logged is sent (this process only: a restart
    # shows the job CANCELLED, and its streams end as a finished job's do)
    ended_why: str = ""
    policy_updates: asyncio.Lock = field(default_factory=asyncio.Lock)  # one UpdatePolicy at a time (update_policy)

    @property
    def ended(self) -> bool:
        """Finished, and its end logged: every rollout it will log is logged (and, delivered in groups, its whole
        groups published). A cancel sets the state first, and its streams keep open until this."""
        return self.finished_at is not None

    def notify(self) -> None:
        """New results, or a new state: every stream looks."""
        for lst in self.listeners:
            lst.wake.set()

    def notify_acked(self, acked: Sequence[int]) -> None:
        """Acks free room in the streams' windows; only a stream waiting for room has to look (an ack woke every
        stream into a read of the log, one per ack, for nothing)."""
        for lst in self.listeners:
            lst.outstanding.difference_update(acked)
            if lst.acked_in_read is not None:
                lst.acked_in_read.update(acked)
            if lst.full:
                lst.wake.set()

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES

    @property
    def wholly_acked(self) -> bool:
        """Every rollout a stream can send is acked: its trainer has it all."""
        return self.acked >= (self.done if self.published is None else self.published)

    @property
    def run_env(self) -> Environment:
        """The environment its rollouts run in; only a job that runs has one."""
        if self.env is None:
            raise EnvironmentNotFoundError(f"job {self.job_id}'s environment {self.spec.env} is not registered")
        return self.env


def select_tasks(env: Environment, spec: JobSpec) -> list[Task]:
    """The job's tasks, in a deterministic order."""
    tasks = list(env.tasks())
    sel = spec.tasks
    if sel.kind == "all":
        return tasks
    if sel.kind == "ids":
        by_id = {t.id: t for t in tasks}
        missing = [i for i in sel.ids if i not in by_id]
        if missing:
            raise InvalidRequestError(
                f"tasks.ids: {len(missing)} unknown task id(s) in {env.ref()}, e.g. {echo_list(missing)}"
            )
        return [by_id[i] for i in dict.fromkeys(sel.ids)]
    if sel.count > len(tasks):
        raise InvalidRequestError(f"tasks.count={sel.count} but {env.ref()} has only {len(tasks)} tasks")
    return random.Random(sel.seed).sample(tasks, sel.count)


class JobManager:
    """Owns the jobs of one orchestrator. Start with `await JobManager.start(...)`."""

    def __init__(
        self,
        store: ResultStore,
        registry: Registry,
        executor: Executor,
        max_in_flight: int,
        metrics: Metrics | None = None,
        capacity: Capacity | None = None,
        caps: CapsConfig | None = None,
        tracer: Tracer = NOOP_TRACER,
        retention_s: float | None = None,
    ) -> None:
        self.caps = caps or CapsConfig()
        self.retention_s = retention_s  # a finished job is removed this long after its end; None: kept for good
        self.tracer = tracer  # each rollout's trace starts here, at its enqueueing
        self._streams = TenantCounter(self.caps.streams_per_tenant, "caps.streams_per_tenant", "streams")
        self.metrics = metrics or Metrics()
        self.store = store
        self.registry = registry
        self.executor = executor
        self.scheduler = Scheduler(max_in_flight, self._run_item, capacity)
        # read when scraped, not set twice per rollout (at thousands of rollouts a second, that is CPU)
        self.metrics.queue_depth.set_function(lambda: self.scheduler.queue_depth)
        self.metrics.in_flight.set_function(lambda: self.scheduler.in_flight)
        for state in JobState:
            self.metrics.jobs.labels(state.value).set_function(functools.partial(self._count_in, state))
        self._jobs: dict[str, _Job] = {}
        # the same jobs by tenant, finished or not: a tenant's list and its early removals read its own, not every
        # tenant's (a tenant at its caps made each of its submits, and each rollout of its logged over the byte cap,
        # a pass over every job of the server: 100 tenants of 1,000 finished jobs, some 10 ms of the event loop a
        # call); its size is the tenant's jobs kept here
        self._by_owner: dict[str, dict[str, _Job]] = {}
        self._log_refusals = LogLimit()
        self._unfinished: Counter[str] = Counter()  # per tenant: counted, not summed over every job ever seen
        self._stored: Counter[str] = Counter()  # per tenant: the bytes its jobs here hold in the result log
        self._admitting: Counter[str] = Counter()  # per tenant: submits past the cap's check, not recorded yet
        self._submitting = 0  # submits in progress
        self._deferred: list[tuple[_Job, PendingItems]] = []  # accepted jobs whose rollouts wait for them
        self._defer_timer: asyncio.TimerHandle | None = None  # START_DEFER_S after the first deferred job
        self._quiet_timer: asyncio.TimerHandle | None = None  # START_QUIET_S after the last submit was answered
        self._expiry: asyncio.Task[None] | None = None
        # finished jobs whose rows this version cannot read (left alone at the start): when each ended (monotonic)
        self._unreadable: dict[str, float] = {}
        self._teardowns: set[asyncio.Future[None]] = set()  # CancelJobs tearing their rollouts down: close waits
        # removals of jobs taken out early (caps.result_bytes_per_tenant), in the background: close stops them (each
        # is marked REMOVING before its rows go, and the next start finishes it)
        self._removals: set[asyncio.Future[None]] = set()
        self._counted: dict[RolloutStatus, MetricCounter] = {}  # metrics.rollouts by status

    @classmethod
    async def start(
        cls,
        store: ResultStore,
        registry: Registry,
        executor: Executor,
        max_in_flight: int = 64,
        metrics: Metrics | None = None,
        capacity: Capacity | None = None,
        caps: CapsConfig | None = None,
        tracer: Tracer = NOOP_TRACER,
        retention_s: float | None = None,
        admit: Callable[[JobSpec], None] | None = None,
        held_envs: Collection[str] = (),
    ) -> JobManager:
        """A manager that has resumed every unfinished job in the store (and removed those whose retention ran out
        while it was down). `admit` raises (an EnvfleetError) for a spec this server would refuse at SubmitJob now
        (its policy URL off the allowlist, say): a resumed job must pass it too. An unfinished job of an environment
        named in `held_envs` (registered, but its reload failed at this start for a passing reason: the disk) waits,
        unfinished and not run, for a start that loads it, where it was cancelled for good as one whose environment is
        gone."""
        mgr = cls(store, registry, executor, max_in_flight, metrics, capacity, caps, tracer, retention_s)
        mgr.scheduler.start()
        await mgr._resume(admit, frozenset(held_envs))
        if retention_s is not None:
            mgr._expiry = asyncio.create_task(mgr._expire_forever(), name="job expiry")
        return mgr

    async def _resume(
        self, admit: Callable[[JobSpec], None] | None = None, held_envs: frozenset[str] = frozenset()
    ) -> None:
        now, mono_now = time.time(), time.monotonic()  # read once: the ends keep their order, however long it takes
        stored_jobs = await self.store.jobs()
        self._unreadable = {
            job_id: ended
            for job_id, end in self.store.unreadable.items()
            if (ended := self._ended(end, now, mono_now)) is not None
        }
        for job_id in self.store.removing:
            await self._remove(job_id, "its removal was cut short by a stop or a crash")
        for stored in stored_jobs:
            if self._expired(stored.finished_at, now):
                await self._remove(stored.job_id)
                continue
            env: Environment | None = None
            with contextlib.suppress(EnvfleetError):  # a job whose environment is gone is ended below, saying so
                env = self.registry.get(stored.spec.env)
            job = _Job(
                stored.job_id,
                stored.spec,
                env,
                stored.total,
                stored.state,
                stored.created_at,
                owner=stored.owner,
                # what was sent before the restart is unknown: count everything already logged as delivered
                delivered=await self.store.last_seq(stored.job_id),
                # a finished job's end was logged with its time (a row without one ends now, not never)
                finished_at=stored.finished_at or (now if stored.state in FINISHED_STATES else None),
            )
            job.ended_mono = self._ended(job.finished_at, now, mono_now)
            by_status, job.acked = await self.store.counts(stored.job_id)
            job.by_status.update(by_status)
            job.done = sum(by_status.values())
            job.stored_bytes = await self.store.stored_bytes(stored.job_id)
            self._add(job)
            if stored.spec.deliver_groups and job.state != JobState.COMPLETED:
                await self.store.publish_complete_groups(job.job_id, stored.spec.group_size)
            if job.finished:
                if stored.spec.deliver_groups:
                    job.published = await self.store.published(job.job_id)
                continue
            if env is None and stored.spec.env.partition("@")[0] in held_envs:
                log.error(
                    "job %s waits: its environment %s did not load at this start (the error is logged above); a "
                    "start that loads it resumes the job, or CancelJob ends it",
                    job.job_id,
                    stored.spec.env,
                )
                continue
            done_ids = await self.store.done_ids(job.job_id)
            try:
                # what SubmitJob checks, under this start's settings: resumed unchecked, a job kept calling a policy
                # URL the operator had since taken off the allowlist, or ran sandboxes past lowered caps
                if admit is not None:
                    admit(stored.spec)
                check_env_limits(job.run_env, self.caps.sandbox)
                items = self._items(job.job_id, job.run_env, stored.spec, owner=stored.owner, skip=done_ids)
                if items:
                    self.scheduler.check_fits(_need(job.run_env))
            except EnvfleetError as e:
                # what changed while it was down (an environment or a task gone, less capacity) ends the job: it stays,
                # so that what it logged is streamed and acked and its retention applies, and the server starts
                log.error("cannot resume job %s, so it is cancelled: %s", job.job_id, e)
                if stored.spec.deliver_groups:  # its whole groups are published above
                    job.published = await self.store.published(job.job_id)
                await self._finish(job, JobState.CANCELLED)
                continue
            log.info("resuming job %s: %d of %d rollouts left", job.job_id, len(items), job.total)
            if not items:
                await self._finish(job, JobState.COMPLETED)
                continue
            self._queue(job.job_id, job.run_env, stored.spec, items, stored.owner)

    def _items(
        self,
        job_id: str,
        env: Environment,
        spec: JobSpec,
        tasks: Sequence[Task] | None = None,
        *,
        owner: str = LOCAL_TENANT,
        skip: Collection[str] = (),
    ) -> PendingItems:
        chosen = select_tasks(env, spec) if tasks is None else tasks
        return PendingItems(job_id, chosen, spec.group_size, enqueued_at=time.monotonic(), tenant=owner, skip=skip)

    async def submit(self, spec: JobSpec, owner: str = LOCAL_TENANT) -> tuple[str, int]:
        """Validate, record and queue a job of tenant `owner`; returns its id and rollout count."""
        self._submitting += 1
        if self._quiet_timer is not None:
            self._quiet_timer.cancel()  # the quiet spell is broken: it starts again when this submit is answered
            self._quiet_timer = None
        try:
            return await self._submit(spec, owner)
        finally:
            self._submitting -= 1
            if not self._submitting and self._deferred:
                self._quiet_timer = asyncio.get_running_loop().call_later(START_QUIET_S, self._start_deferred)

    async def _submit(self, spec: JobSpec, owner: str) -> tuple[str, int]:
        env = self.registry.get(spec.env, owner)
        check_env_limits(env, self.caps.sandbox)
        # submits being admitted count too: side by side (a burst, one commit for all) each saw the same count
        unfinished = self._unfinished[owner] + self._admitting[owner]
        if unfinished >= self.caps.jobs_per_tenant:
            raise BusyError(
                f"{unfinished} jobs are unfinished; caps.jobs_per_tenant is {self.caps.jobs_per_tenant}; "
                "cancel some or wait for them to finish"
            )
        if self._stored[owner] > self.caps.result_bytes_per_tenant:
            self._trim_results(owner)
            if self._stored[owner] > self.caps.result_bytes_per_tenant:
                raise QuotaExceededError(
                    f"{self._results_held(owner)}: ack the rollouts of finished jobs (a finished job wholly acked, "
                    "that no stream reads, then goes), or cancel unfinished ones"
                )
        self._admitting[owner] += 1
        handed_over: list[bool] = []  # to the job's record, which lets go of the admission once the job counts
        try:
            return await self._admit(spec, env, owner, handed_over)
        finally:
            if not handed_over:
                self._admitted(owner)

    def _admitted(self, owner: str) -> None:
        self._admitting[owner] -= 1
        if not self._admitting[owner]:
            del self._admitting[owner]

    async def _admit(self, spec: JobSpec, env: Environment, owner: str, handed_over: list[bool]) -> tuple[str, int]:
        if len(self._by_owner.get(owner, ())) - self._unfinished[owner] >= self.caps.finished_jobs_per_tenant:
            await self._trim_finished(owner)
        spec = spec.model_copy(update={"env": env.ref()})
        job_id = uuid.uuid4().hex[:16]
        tasks = select_tasks(env, spec)
        if not tasks:
            raise InvalidRequestError(f"{env.ref()} selects no tasks")
        total = len(tasks) * spec.group_size  # checked before a single work item is built
        if total > MAX_ROLLOUTS_PER_JOB:
            raise InvalidRequestError(
                f"tasks x group_size = {len(tasks)} x {spec.group_size} = {total} rollouts; "
                f"the limit per job is {MAX_ROLLOUTS_PER_JOB}"
            )
        if total > self.caps.rollouts_per_job:
            raise QuotaExceededError(
                f"tasks x group_size = {len(tasks)} x {spec.group_size} = {total} rollouts; "
                f"caps.rollouts_per_job is {self.caps.rollouts_per_job}"
            )
        items = self._items(job_id, env, spec, tasks, owner=owner)
        self.scheduler.check_fits(_need(env))  # refused before anything is recorded
        # recorded to its end even when the call is cancelled: the log's row was written all the same, and a job
        # missing from memory was run by the next start with nobody to stream it (a client's deadline in a burst)
        # the admission counts until the job does (_add): let go when a cancelled caller returned, the next submit's
        # check missed the job being recorded, and cancelled submits stacked jobs past jobs_per_tenant
        handed_over.append(True)
        # counted now: queued (by a submit beside it, whose start timer fires first), its items start being made at once
        await run_to_end(self._record(job_id, spec, env, items, owner))
        return job_id, total

    async def _record(self, job_id: str, spec: JobSpec, env: Environment, items: PendingItems, owner: str) -> None:
        try:
            await self.store.create_job(job_id, spec, len(items), owner)
            job = _Job(job_id, spec, env, len(items), JobState.QUEUED, time.time(), owner=owner)
            self._add(job)
        finally:
            self._admitted(owner)
        self._deferred.append((job, items))  # started when this submit and those beside it are answered
        if self._defer_timer is None:
            self._defer_timer = asyncio.get_running_loop().call_later(START_DEFER_S, self._start_deferred)

    def _start_deferred(self) -> None:
        """Queue the accepted jobs' rollouts (a job cancelled meanwhile has none to run)."""
        self._cancel_start_timers()
        deferred, self._deferred = self._deferred, []
        for job, items in deferred:
            if not job.finished:
                self._queue(job.job_id, job.run_env, job.spec, items, job.owner)

    def _cancel_start_timers(self) -> None:
        for timer in (self._defer_timer, self._quiet_timer):
            if timer is not None:
                timer.cancel()
        self._defer_timer = self._quiet_timer = None

    def _queue(self, job_id: str, env: Environment, spec: JobSpec, items: PendingItems, owner: str) -> None:
        """Hand a job's items to the scheduler; while its image is missing it is built in the background and the
        slots go to jobs whose images exist."""
        images = self.executor.images
        ready = images.ready(env)
        self.scheduler.add_job(
            job_id, spec.priority, spec.max_concurrency, items, _need(env), ready=ready, tenant=owner
        )
        if not ready:
            images.prebuild(env).add_done_callback(lambda _: self.scheduler.set_ready(job_id))

    async def _logged(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """A write to the result log, tried until it is made: a full disk or a file locked by hand fails it for a
        while, and the rollout it carries waits in memory meanwhile, neither lost nor its job left hanging (a
        CancelJob or the shutdown cancels the wait)."""
        delay = LOG_RETRY_FIRST_S
        while True:
            try:
                return await call()
            except (sqlite3.Error, OSError) as e:
                if (more := self._log_refusals.allow(type(e).__name__)) is not None:  # said by every rollout waiting
                    log.error("the result log refused %s (%s); trying again in %.1fs%s", what, e, delay, more)
                await asyncio.sleep(delay)
                delay = min(2 * delay, LOG_RETRY_MAX_S)

    async def _run_item(self, item: WorkItem) -> None:
        job = self._jobs[item.job_id]
        if job.state == JobState.QUEUED:
            job.state = JobState.RUNNING
            await self._logged("a job's start", lambda: self.store.set_job_state(job.job_id, JobState.RUNNING))
        self.metrics.queue_wait_seconds.observe(time.monotonic() - item.enqueued_at)
        env = job.run_env
        try:
            rollout = await traced_rollout(
                self.tracer, item, env.ref(), lambda traced: self.executor.run(traced, env, job.spec)
            )
        except Exception as e:  # an executor's bug: the rollout is masked, never lost (the job would never end)
            log.error("rollout %s: the executor failed", item.id, exc_info=e)
            error = RolloutError(kind=type(e).__name__, message=f"the rollout could not be run: {e}"[:2000])
            rollout = unrun_rollout(item, env.ref(), job.spec.policy.version, error)
        if job.state == JobState.CANCELLED:
            self._count(rollout.status)
            return
        grouped = job.spec.deliver_groups
        try:
            appended = await self._logged(
                f"rollout {item.id}", lambda: self.store.append_sized(rollout, visible=not grouped)
            )
        except ValueError as e:  # a rollout the log cannot encode (a bug upstream): masked, never lost
            log.error("rollout %s cannot be stored", item.id, exc_info=e)
            error = RolloutError(kind=type(e).__name__, message=f"the rollout could not be stored: {e}"[:2000])
            rollout = unrun_rollout(item, env.ref(), job.spec.policy.version, error, rollout.attempts)
            appended = await self._logged(
                f"rollout {item.id}", lambda: self.store.append_sized(rollout, visible=not grouped)
            )
        if appended is None:
            return  # already in the log (a resumed duplicate): counted when it was first run
        job.stored_bytes += appended[1]
        if self._jobs.get(job.job_id) is job:  # not removed meanwhile (a cancelled job's last appends)
            self._stored[job.owner] += appended[1]
        # counted as the log holds it: a rollout the log could not encode is the INFRA_ERROR stored in its place
        self._count(rollout.status)
        if grouped:
            await self._logged(
                f"group {item.group_id}",
                lambda: self.store.publish_complete_groups(job.job_id, job.spec.group_size, item.group_id),
            )
        job.done += 1
        job.by_status[rollout.status.value] += 1
        if job.done >= job.total:
            await self._finish(job, JobState.COMPLETED)
        job.notify()
        if self._stored[job.owner] > self.caps.result_bytes_per_tenant:
            self._results_over(job)

    def _count(self, status: RolloutStatus) -> None:
        counted = self._counted.get(status)
        if counted is None:  # a labelled child looked up once per status, not per rollout
            counted = self._counted[status] = self.metrics.rollouts.labels(status.value)
        counted.inc()

    def _add(self, job: _Job) -> None:
        self._jobs[job.job_id] = job
        self._by_owner.setdefault(job.owner, {})[job.job_id] = job
        self._unfinished[job.owner] += not job.finished
        self._stored[job.owner] += job.stored_bytes

    def _forget(self, jobs: Sequence[_Job]) -> None:
        """Take finished jobs out: GetJob, streams and acks see no such job from here on."""
        for job in jobs:
            del self._jobs[job.job_id], self._by_owner[job.owner][job.job_id]
            self._stored[job.owner] -= job.stored_bytes
            if not self._by_owner[job.owner]:  # a tenant with nothing kept has no entry (tenants come and go)
                del self._by_owner[job.owner], self._unfinished[job.owner], self._stored[job.owner]

    def _set_state(self, job: _Job, state: JobState) -> None:
        was = job.finished
        job.state = state
        if job.finished != was:
            self._unfinished[job.owner] += -1 if job.finished else 1

    async def _finish(self, job: _Job, state: JobState) -> None:
        self.executor.job_ended(job.job_id)
        self._set_state(job, state)
        job.finished_at = time.time()
        job.ended_mono = time.monotonic()
        try:
            await self._logged(f"job {job.job_id}'s end", lambda: self.store.set_job_state(job.job_id, state))
        finally:
            job.notify()

    def _job(self, job_id: str, owner: str | None = None) -> _Job:
        """The job; for a caller `owner`, another tenant's job is reported exactly like a missing one."""
        job = self._jobs.get(job_id)
        if job is None or (owner is not None and job.owner != owner):
            kept = "" if self.retention_s is None else f"a finished job is kept {self.retention_s:g}s after its end; "
            kept = f" ({kept}a tenant keeps its last {self.caps.finished_jobs_per_tenant} finished jobs)"
            raise JobNotFoundError(f"no job {echo(job_id)}{kept}")
        return job

    async def stream(
        self,
        job_id: str,
        resume_after: int = 0,
        max_in_flight: int = 256,
        max_batch: int = 64,
        *,
        owner: str | None = None,
    ) -> AsyncIterator[Batch]:
        """Unacked rollouts (or whole groups) after `resume_after` in seq order, at most `max_in_flight` unacked at
        once (a group is never split, so it may exceed that by group_size - 1); ends once the job is finished and
        everything logged has been sent."""
        job = self._job(job_id, owner)
        if resume_after > job.delivered:
            # seqs are the log's, across jobs: a cursor of another job's, or made up, skipped every unacked rollout
            # up to it and ended the stream as if the job had no more
            raise InvalidRequestError(
                f"resume_after={resume_after}: no rollout of job {job_id} was sent after seq {job.delivered}; "
                "resume after the last seq this job's stream gave you"
            )
        if resume_after:
            # below what was sent, a seq of another job's (seqs are shared by all jobs) skipped this job's unacked
            # rollouts up to it all the same; and one inside a group sent its rest as a short group, its
            # advantages made of that rest alone
            point = await self.store.resume_point(job_id, resume_after, grouped=job.spec.deliver_groups)
            if point is None:
                raise InvalidRequestError(
                    f"resume_after={resume_after} is no seq of job {job_id}: resume after a seq this job's stream "
                    "gave you, or from 0 (acked rollouts are never sent again)"
                )
            resume_after = point
        with self._streams.hold(job.owner):
            async with contextlib.aclosing(self._stream(job, resume_after, max_in_flight, max_batch)) as batches:
                async for batch in batches:
                    yield batch

    async def _stream(self, job: _Job, resume_after: int, max_in_flight: int, max_batch: int) -> AsyncGenerator[Batch]:
        job_id = job.job_id
        n = job.spec.group_size if job.spec.deliver_groups else 1
        cursor = resume_after
        me = _Listener()
        job.listeners.append(me)
        loop = asyncio.get_running_loop()
        sent_at = float("-inf")
        part_of: _PartOf | None = None  # the group this stream is sending in parts, while more of it is to come
        try:
            while True:
                me.wake.clear()
                finished = job.ended
                room = max_in_flight - len(me.outstanding)
                entries: list[LogEntry] = []
                read: list[LogEntry] = []
                backlog = False
                if room > 0 or part_of is not None:  # the window never cuts a group: its parts go on
                    # a group's row more than the window or the batch asks for: a read that ends with a whole group
                    # sees where it ends (else each group of max_batch rows or more went in parts, two log calls more)
                    limit = max(min(room, max_batch), n) + (n > 1)
                    me.acked_in_read = set()
                    read = await self.store.read(
                        job_id, cursor, limit, STREAM_BATCH_BYTES, scores=job.spec.deliver_groups
                    )
                    # more is logged when the read stopped at its limit, or at its bytes: a first rollout over them
                    # alone went out, and the rest waited for the next result to wake the stream
                    backlog = len(read) == limit or sum(map(_size, read)) > STREAM_BATCH_BYTES
                    if part_of is not None and (not read or read[0].group_id != part_of.group_id):
                        part_of = None  # its rest was acked meanwhile (another stream of the job sent it all first)
                    if n == 1:
                        entries = read[: _within_bytes(read, STREAM_BATCH_BYTES)] if read else []
                    elif read:
                        entries, part = _grouped_message(read, STREAM_BATCH_BYTES, backlog, part_of is not None)
                        if part:
                            part_of = await self._part(job, part_of, entries, read, backlog)
                acked_meanwhile, me.acked_in_read = me.acked_in_read or set(), None
                if entries:
                    cursor = entries[-1].seq
                    job.delivered = max(job.delivered, cursor)
                    me.outstanding.update(e.seq for e in entries if e.seq not in acked_meanwhile)
                    if part_of is not None and part_of.group_id == entries[0].group_id:
                        yield part_of.batch(entries)
                        part_of = part_of if part_of.more else None
                    else:
                        # a group of one is a group too: streamed as plain rollouts, its job's groups() refused it
                        yield _batch(entries, grouped=job.spec.deliver_groups, advantage=job.spec.advantage)
                    sent_at = loop.time()
                    if backlog or finished or part_of is not None or len(entries) < len(read):
                        # more is logged already (or the end is near, or the group goes on, or the read held more
                        # than the message: whole groups behind a group's last part): read on
                        continue
                # a full window must not keep a finished stream open: end when nothing is left to send
                elif finished and (room > 0 or not await self.store.read(job_id, cursor, 1)):
                    if job.ended_why:
                        raise QuotaExceededError(job.ended_why)
                    return
                me.full = len(me.outstanding) >= max_in_flight
                if room <= 0 and not me.full:
                    # acks freed room while the log was read above (they woke nobody: the window was not marked
                    # full yet); waiting now would wait for an ack that already came, at the end of a job forever
                    continue
                await me.wake.wait()
                # while it reads and sends, an ack changes nothing it is about to look at: it wakes no read
                waited_for_room, me.full = me.full, False
                if not waited_for_room and not job.ended and (gap := sent_at + STREAM_GAP_S - loop.time()) > 0:
                    # results coming quicker than one a gap: the ones landing meanwhile go out together (at 50 a
                    # second each alone cost a log read, a message, and the trainer's ack)
                    await asyncio.sleep(gap)
        finally:
            job.listeners.remove(me)

    async def _part(
        self, job: _Job, part_of: _PartOf | None, part: list[LogEntry], read: list[LogEntry], cut: bool
    ) -> _PartOf:
        """The group `part` is a part of, and whether another part follows it: a row of the group after it in the
        read, or, when the read ends with it and was cut, in the log."""
        group_id = part[0].group_id
        if part_of is None or part_of.group_id != group_id:
            task_id, scores = await self.store.group_scores(job.job_id, group_id)
            advantages, failed = _group_scores([(status, reward) for _, status, reward in scores], job.spec.advantage)
            part_of = _PartOf(
                group_id, task_id, {seq: a for (seq, _, _), a in zip(scores, advantages, strict=True)}, failed
            )
        after = read[len(part) :]
        if after:
            part_of.more = after[0].group_id == group_id
        else:
            part_of.more = cut and await self.store.next_group(job.job_id, part[-1].seq) == group_id
        return part_of

    async def ack(self, job_id: str, up_to: int, ids: Sequence[str], *, owner: str | None = None) -> int:
        """Ack rollouts; returns how many were newly acked. An up_to beyond every seq delivered is refused: it
        would ack rollouts the trainer never saw; ids not delivered yet are not acked, and in a job delivered in
        groups an id acks its whole group."""
        job = self._job(job_id, owner)
        if up_to < 0:
            raise InvalidRequestError(f"up_to must be >= 0, got {up_to}")
        if up_to > job.delivered:
            raise InvalidRequestError(f"up_to={up_to}: nothing delivered after seq {job.delivered}")
        # the log's ack and the streams' notice of it run to their end together: the store runs a queued call even
        # when its caller is cancelled (an Ack RPC past its deadline), and without the notice the acked seqs stayed
        # in a stream's window for good, which a later ack (acking nothing new) never freed: a full window hung
        return len(await run_to_end(self._ack(job, up_to, ids)))

    async def _ack(self, job: _Job, up_to: int, ids: Sequence[str]) -> list[int]:
        seqs, freed = await self.store.ack_sized(
            job.job_id, up_to, ids, delivered=job.delivered, whole_groups=job.spec.deliver_groups
        )
        job.stored_bytes -= freed
        if self._jobs.get(job.job_id) is job:
            self._stored[job.owner] -= freed
        job.acked += len(seqs)
        job.notify_acked(seqs)
        return seqs

    async def update_policy(
        self, job_id: str, version: str, base_url: str, *, api_key: str | None = None, owner: str | None = None
    ) -> JobInfo:
        """Rollouts started from now on use this endpoint and record this version. `api_key` None keeps the job's
        key, which stays on the origin it was given for: a base_url elsewhere must come with its own (or "")."""
        job = self._job(job_id, owner)
        # one at a time, each to its end once begun: two side by side both began from the old endpoint and the later
        # write undid the other, and one cancelled after the log's write left the old endpoint in force here
        await run_to_end(self._update_policy(job, version, base_url, api_key))
        return await self.info(job_id)

    async def _update_policy(self, job: _Job, version: str, base_url: str, api_key: str | None) -> None:
        async with job.policy_updates:
            await self._set_policy(job, version, base_url, api_key)

    async def _set_policy(self, job: _Job, version: str, base_url: str, api_key: str | None) -> None:
        if job.finished:
            raise JobFinishedError(f"job {job.job_id} is {job.state.value}; its policy can no longer change")
        current = job.spec.policy
        update = (
            {"version": version}
            | ({"base_url": base_url} if base_url else {})
            | ({"api_key": api_key} if api_key is not None else {})
        )
        try:
            endpoint = current.model_validate({**current.model_dump(), **update})
            # whoever holds the tenant's token could otherwise move the key to a host of theirs and read it there
            # (no call answers it: it is a secret field)
            if api_key is None and current.api_key and origin(endpoint.base_url) != origin(current.base_url):
                raise ValueError(
                    f"base_url {shown_url(endpoint.base_url)} is on another origin than the job's "
                    f"{shown_url(current.base_url)}, and the job's api_key goes only where it was given: send "
                    f"api_key with the new base_url (empty for none)"
                )
            if endpoint == current:  # nothing to change: no write, and no spec sent to the workers again
                return
            # the whole spec, checked as a submit checks it: an endpoint fine alone may not be for the job (a tito
            # job's on the replay policy), and one kept unchecked broke every read of the job, and the next start.
            # Its task selection (up to 100,000 ids, checked at the submit) is kept as it is, not checked again
            checked = JobSpec.model_validate(
                {**job.spec.model_dump(exclude={"tasks"}), "policy": endpoint.model_dump()}
            )
        except ValueError as e:  # by fields and reasons: pydantic's own text quotes the values, the api_key among them
            raise InvalidRequestError(f"policy update: {error_text(e)}") from None
        # the log first: a write it refused (a full disk, a lock) left the new endpoint in force in memory only, the
        # trainer's retry answered OK with nothing written ("nothing to change"), and a restart went back to the old
        await self.store.update_policy(job.job_id, checked.policy)
        job.spec = checked.model_copy(update={"tasks": job.spec.tasks})

    async def cancel(self, job_id: str, *, owner: str | None = None) -> JobInfo:
        """Stop a job: pending work is dropped and running rollouts are cancelled (their sandboxes destroyed)."""
        job = self._job(job_id, owner)
        if not job.finished:
            # to its end even when the call is cancelled (a CancelJob past its deadline while sandboxes are torn
            # down): half done, the log said RUNNING, streams were never woken, and a restart ran the job again
            await run_to_end(self._start_cancel(job))
        return await self.info(job_id)

    def _start_cancel(self, job: _Job) -> asyncio.Future[None]:
        """Cancel an unfinished job in the background; the future ends once it is torn down and its end logged."""
        self._set_state(job, JobState.CANCELLED)
        return self._background(self._cancel(job), self._teardowns)

    @staticmethod
    def _background(work: Awaitable[None], held: set[asyncio.Future[None]]) -> asyncio.Future[None]:
        """Run `work` whoever waits for it, held in `held` until it ends."""
        running = asyncio.ensure_future(work)
        held.add(running)
        running.add_done_callback(held.discard)
        return running

    async def _cancel(self, job: _Job) -> None:
        job_id = job.job_id
        try:
            # logged before the teardown, which takes a while (a removal per running rollout): a stop or a crash
            # meanwhile left the log RUNNING, and the next start ran the cancelled job again (_resume publishes its
            # whole groups, had the cut come before that step below)
            stopping = self.scheduler.drop_job(job_id)  # first, at once: a log that refuses writes holds the next step
            await self._logged(f"job {job_id}'s cancel", lambda: self.store.set_job_state(job_id, JobState.CANCELLED))
            await asyncio.gather(*stopping, return_exceptions=True)
            # a rollout cancelled while its append waited in the log's queue was logged all the same (the store runs
            # a queued call to its end), but neither counted nor, delivered in groups, its group published: the
            # counts come from the log (behind those appends), and its whole groups go out, as a resume makes them
            if job.spec.deliver_groups:
                n = job.spec.group_size
                await self._logged(f"job {job_id}'s groups", lambda: self.store.publish_complete_groups(job_id, n))
                # a group it never completed is never sent, nor acked: counted, it kept the job "not wholly acked"
                job.published = await self._logged(f"job {job_id}'s groups", lambda: self.store.published(job_id))
            by_status, job.acked = await self._logged(f"job {job_id}'s counts", lambda: self.store.counts(job_id))
            job.by_status = Counter(by_status)
            job.done = sum(by_status.values())
            stored = await self._logged(f"job {job_id}'s bytes", lambda: self.store.stored_bytes(job_id))
            if self._jobs.get(job_id) is job:
                self._stored[job.owner] += stored - job.stored_bytes
            job.stored_bytes = stored
        finally:  # its streams wait for the end (_Job.ended), which a failed step above must not hold back
            await self._finish(job, JobState.CANCELLED)

    async def info(self, job_id: str, *, owner: str | None = None) -> JobInfo:
        """Status, counts by rollout status, throughput."""
        return self._info(self._job(job_id, owner))

    def _info(self, job: _Job) -> JobInfo:
        # the counts kept as rollouts were logged and acked: a list of thousands of jobs reads no log
        done = job.done
        # the average since submit, frozen once the job is finished (documented on JobStatus.rollouts_per_s); none
        # when the wall clock went back past the submit (it was done x 1e9)
        elapsed = (job.finished_at or time.time()) - job.created_at
        return JobInfo(
            job_id=job.job_id,
            spec=job.spec,
            state=job.state,
            created_at=job.created_at,
            finished_at=job.finished_at,
            counts=JobCounts(
                total=job.total,
                done=done,
                by_status=dict(job.by_status),
                acked=job.acked,
                in_flight=self.scheduler.running_of(job.job_id),
                rollouts_per_s=done / elapsed if elapsed > 0 else 0.0,
            ),
        )

    async def list(self, *, owner: str | None = None) -> list[JobInfo]:
        """Every job this orchestrator knows (of tenant `owner` only, when given)."""
        jobs = self._jobs if owner is None else self._by_owner.get(owner, {})
        return [self._info(job) for job in jobs.values()]

    def _expired(self, end: float | None, now: float) -> bool:
        """Whether a job that ended at `end` is past its retention at `now`, both on one clock: the wall clock at a
        start (as the log keeps ends: only it spans the stop), the monotonic one in a running process (`ended_mono`)."""
        return self.retention_s is not None and end is not None and now - end >= self.retention_s

    def _ended(self, finished_at: float | None, now: float, mono_now: float) -> float | None:
        """A logged end (wall clock) on this process's monotonic clock, both read at `now` and `mono_now`: as long ago
        as the wall clock says, never in the future (a clock set back) nor longer ago than the retention (a job past
        it was removed at the start)."""
        if finished_at is None:
            return None
        ago = min(max(now - finished_at, 0.0), self.retention_s if self.retention_s is not None else float("inf"))
        return mono_now - ago

    async def _expire_forever(self) -> None:
        assert self.retention_s is not None
        every = min(max(self.retention_s / 4, 0.05), EXPIRY_EVERY_MAX_S)
        while True:
            await asyncio.sleep(every)
            try:
                await self.expire()
            except Exception as e:  # a bug here must not end the expiry for good; the next round tries again
                log.error("removing expired jobs failed", exc_info=e)

    async def expire(self) -> int:
        """Remove the finished jobs whose retention ran out and that no stream reads now; returns how many."""
        now = time.monotonic()
        gone = [j for j in self._jobs.values() if self._expired(j.ended_mono, now) and not j.listeners]
        self._forget(gone)
        for job in gone:
            await self._remove(job.job_id)
        # a finished job whose row this version cannot read (left alone at the start) has a retention all the same:
        # never loaded, it was never expired, and it and its rollouts stayed in the log for good
        unreadable = [job_id for job_id, ended in self._unreadable.items() if self._expired(ended, now)]
        for job_id in unreadable:
            del self._unreadable[job_id]
            self.store.unreadable.pop(job_id, None)
            await self._remove(
                job_id,
                f"its row does not load in this version, and its retention of "
                f"{self.retention_s:g}s after its end ran out",
            )
        return len(gone) + len(unreadable)

    def _oldest_finished(self, owner: str, *, acked: bool = False) -> Sequence[_Job]:
        """Tenant `owner`'s finished jobs that may go before their retention runs out, the oldest end first: none
        that a stream reads, and with `acked` only those whose every rollout is acked."""
        # a cancel still under way (finished, no end time yet) is no candidate: it sorted as the oldest, and was
        # removed from under the CancelJob tearing it down, which then said NOT_FOUND
        return sorted(
            (
                j
                for j in self._by_owner.get(owner, {}).values()
                if j.finished and j.ended_mono is not None and not j.listeners and (not acked or j.wholly_acked)
            ),
            key=lambda j: j.ended_mono or 0.0,
        )

    async def _trim_finished(self, owner: str) -> None:
        """Make room for one more finished job of tenant `owner` under caps.finished_jobs_per_tenant: its oldest go
        before their retention runs out (a tenant submitting and cancelling in a loop kept every spec, up to 100,000
        task ids each, for the whole retention)."""
        finished = self._oldest_finished(owner)
        gone = finished[: max(0, len(finished) - self.caps.finished_jobs_per_tenant + 1)]
        self._forget(gone)
        why = f"its tenant had {self.caps.finished_jobs_per_tenant} finished (caps.finished_jobs_per_tenant)"
        await self._remove_early(gone, why)

    def _trim_results(self, owner: str) -> None:
        """Bring tenant `owner`'s bytes in the result log under caps.result_bytes_per_tenant with its oldest finished
        jobs wholly acked, where they can: out of memory at once, out of the log in the background. A tenant whose
        policy answered 16 MiB turns, or whose trainer never read, filled the log's disk, and every tenant's results
        then waited for room."""
        cap = self.caps.result_bytes_per_tenant
        # only what its trainer has: results not acked yet are delivered at least once, as a job's retention keeps them
        finished = self._oldest_finished(owner, acked=True)
        n, over = 0, self._stored[owner] - cap
        while n < len(finished) and over > 0:
            over -= finished[n].stored_bytes
            n += 1
        if over > 0:
            return  # removing them would not do: they keep their retention
        if gone := finished[:n]:
            self._forget(gone)
            why = f"its tenant's jobs held over caps.result_bytes_per_tenant ({cap} bytes) of results"
            self._background(self._remove_early(gone, why), self._removals)

    def _results_over(self, job: _Job) -> None:
        """Job `job` logged a rollout that took its tenant over caps.result_bytes_per_tenant: its finished jobs wholly
        acked go first, and where they cannot bring it under, the job is cancelled, its streams told why."""
        self._trim_results(job.owner)
        if self._stored[job.owner] > self.caps.result_bytes_per_tenant and not job.finished:
            # a job that runs for weeks holds every rollout it delivered until it is removed, unless acks slim them
            job.ended_why = (
                f"job {job.job_id} was cancelled: {self._results_held(job.owner)}. Ack the rollouts of finished jobs; "
                "for a job this large ask the operator for a higher cap, or for --result-log-acked slim (an acked "
                "rollout then keeps its record, not its turns and tokens)"
            )
            log.warning("%s", job.ended_why)
            self._start_cancel(job)

    def _results_held(self, owner: str) -> str:
        return (
            f"the tenant's jobs hold {self._stored[owner]} bytes of results in the result log, over "
            f"caps.result_bytes_per_tenant = {self.caps.result_bytes_per_tenant}, and its finished jobs whose "
            "rollouts are all acked (which may go early) hold too little of it"
        )

    async def _remove_early(self, gone: Sequence[_Job], why: str) -> None:
        """Remove jobs taken out of memory (_forget) before their retention ran out, saying `why`."""
        if len(gone) > 1:  # all marked at once: a submit cancelled during the first removal left the others loadable
            ids = [job.job_id for job in gone]
            await self._logged("the trimmed jobs' removal", lambda: self.store.mark_removing(ids))
        for job in gone:
            await self._remove(job.job_id, why)

    async def _remove(self, job_id: str, why: str = "") -> None:
        why = why or f"its retention of {self.retention_s:g}s after its end ran out"
        log.info("job %s removed: %s", job_id, why)
        self.metrics.jobs_removed.inc()
        await self._logged(f"job {job_id}'s removal", functools.partial(self.store.remove_job, job_id))

    def _count_in(self, state: JobState) -> int:
        # read at a scrape, on the metrics server's thread: the dict's values copied first (scheduler.queue_depth)
        return sum(job.state == state for job in list(self._jobs.values()))

    async def close(self) -> None:
        """Stop running rollouts (their sandboxes are destroyed); unfinished jobs resume at the next start."""
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        self._cancel_start_timers()
        self._deferred.clear()  # recorded, so resumed at the next start like any unfinished job
        await self.scheduler.close()
        for job in self._jobs.values():
            job.notify()
        await self.executor.close()
        # cancels still tearing down finish (their sandboxes are gone with the executor's) before the log closes
        for removal in self._removals:
            removal.cancel()
        await asyncio.gather(*self._teardowns, *self._removals, return_exceptions=True)


def _need(env: Environment) -> Need:
    return Need(cpus=env.limits.cpus, memory_mb=env.limits.memory_mb)


def _size(e: LogEntry) -> int:
    """An entry's bytes: the wire form as stored, else the JSON's UTF-8, about as long as its message or longer."""
    return len(e.wire) if e.wire is not None else len(e.payload.encode())


def _within_bytes(entries: list[LogEntry], budget: int) -> int:
    """How many of `entries` (from the first) one message carries within `budget` bytes; the first goes even past
    the budget, by itself."""
    total = 0
    for i, e in enumerate(entries):
        total += _size(e)
        if total > budget:
            return max(i, 1)
    return len(entries)


def _grouped_message(entries: list[LogEntry], budget: int, cut: bool, continuing: bool) -> tuple[list[LogEntry], bool]:
    """What of a read of a job delivered in groups one message carries, and whether it is a part of a group: the
    whole groups from the first that fit `budget` together; else (the first group alone is over it, or the read ends
    inside it, or it is the rest of a group sent in parts: `continuing`) the first group's rows within the budget, a
    part. `cut`: the read stopped at its limit or bytes, so its last group may go on past it (a read that ends by
    itself ends on a group's end: groups are published whole). Read whole and sent in one message, a group of 1,024
    long episodes was gigabytes in the control plane's memory, and past max_message_bytes it failed every stream."""
    if not continuing:
        whole = total = 0
        while whole < len(entries):
            g = entries[whole].group_id
            end = next((i for i in range(whole, len(entries)) if entries[i].group_id != g), len(entries))
            size = sum(_size(e) for e in entries[whole:end])
            if (end == len(entries) and cut) or total + size > budget:
                break  # it may go on past the read, or it takes the message past its bytes
            total += size
            whole = end
        if whole:
            return entries[:whole], False
    first = entries[0].group_id
    lead = next((i for i, e in enumerate(entries) if e.group_id != first), len(entries))
    return entries[: _within_bytes(entries[:lead], budget)], True


@dataclass
class _PartOf:
    """A group a stream sends in parts: its advantages and failed count are the whole group's (read from the log's
    columns and two JSON fields, not from every member's whole JSON), and `more` says whether the part being sent is
    followed by another."""

    group_id: str
    task_id: str
    advantages: dict[int, float | None]  # by seq
    failed: int
    more: bool = True

    def batch(self, entries: list[LogEntry]) -> Batch:
        advantages = [self.advantages.get(e.seq) for e in entries]
        return Batch(groups=[Group(self.group_id, self.task_id, entries, advantages, self.failed, self.more)])


def _batch(entries: list[LogEntry], grouped: bool, advantage: AdvantageMode = "grpo") -> Batch:
    if not grouped:
        return Batch(entries=entries)
    by_group: dict[str, list[LogEntry]] = {}
    for e in entries:
        by_group.setdefault(e.group_id, []).append(e)
    groups = []
    for g, members in by_group.items():
        # from the log's status column and the reward SQLite read out of the JSON: a model of every member (a
        # validation of megabytes each) cost the control plane, and one a newer validator refused stopped the stream
        advantages, failed = _group_scores([(m.status, m.reward) for m in members], advantage)
        groups.append(Group(g, members[0].task_id, members, advantages, failed))
    return Batch(groups=groups)


def _group_scores(members: list[tuple[str, float | None]], advantage: AdvantageMode) -> tuple[list[float | None], int]:
    """A group's advantages and failed count, from each member's logged status and reward (whole or in parts)."""
    rewards = [reward if _scored(status) else None for status, reward in members]
    return group_advantages(rewards, advantage), sum(not _scored(status) for status, _ in members)


def _scored(status: str) -> bool:
    """Whether a logged status is a scored one (one this version does not know is not)."""
    known = RolloutStatus._value2member_map_.get(status)
    return isinstance(known, RolloutStatus) and known.scored
