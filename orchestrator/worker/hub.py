"""The control plane's side of rollout workers: who is connected, what each runs, and what happens when one is
lost. `WorkerHub` is an Executor: the job manager hands it rollouts as it would run them locally.

Placement: the samples of a group go to the worker that ran the group's first sample (its snapshot and warm
sandboxes are there); otherwise the least loaded worker, preferring a host that already ran the environment (its
image is there). A rollout is placed only while the connected workers have a free slot between them (each says in
its hello how many rollouts it runs at once); otherwise it waits in line here, so a lost worker's share waits for
room instead of piling onto the others. A worker is lost when its stream ends or its heartbeats stop (a crashed,
killed, stopped or partitioned process; a silent process of this host that still uses CPU is starved, not lost).
Its unfinished rollouts go to other workers as infrastructure retries, within the job's `max_infra_retries`; past
that budget the rollout is INFRA_ERROR, never a reward. A late answer from a lost worker is dropped: the result log
keeps one rollout per id.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

from orchestrator.core.environment import Environment, ImageSource, environment_digest, scoring_budget
from orchestrator.core.errors import SandboxError
from orchestrator.core.models import EncodedRollout, JobSpec, Rollout, RolloutError, RolloutStatus
from orchestrator.core.processes import cpu_ticks
from orchestrator.rollout.runner import RETRY_BACKOFF_CAP_S, WorkItem, attempt_s, left_retries, unrun_rollout
from orchestrator.service.archives import ArchiveCatalog
from orchestrator.service.declarative.env import DeclarativeEnvironment
from orchestrator.worker.metrics import MAX_SNAPSHOT_BYTES
from orchestrator.worker.outbox import MAX_BATCH, Outbox, as_messages
from orchestrator.worker.results import MAX_WIRE_BYTES, InvalidResultError, add_attempts, decode
from protos import worker_pb2 as wpb

log = logging.getLogger(__name__)

# how long a worker's engine is down (as its heartbeats say) before its rollouts that wait for it move to other hosts:
# a dockerd restarting in a few seconds is waited for, where a move spends a retry and the group's snapshot locality
ENGINE_MOVE_AFTER_S = 5.0
RESULT_SLACK_S = 120.0  # on top of a rollout's own time budget, before its worker counts as stuck
# A cancelled rollout's slot (and the CancelJob that cancelled it) waits this long at most for its worker to say that
# its sandbox is gone: freed at once, the worker was sent new rollouts while it still tore the cancelled ones down,
# up to twice its slots' sandboxes after a large cancel, and CancelJob answered before any sandbox was destroyed
CANCEL_ACK_S = 20.0  # below the SDK's 30 s call timeout: a CancelJob past it answers, its slots freed
OVERDUE_SWEEP_S = 1.0  # how often a worker's rollouts are checked against their budgets (one timer each would cost)
HEARD_TICK_S = 1.0  # how often a silent worker's silence is added up (see WorkerHub._next)
STARVED_CUTOFFS = 6  # heartbeat cut-offs in a row a silent local worker that uses CPU is kept past (WorkerHub._next)
MAX_TRACKED_GROUPS = 100_000
DISPATCH_SAMPLES = 100_000
MAX_ASSIGN_BYTES = 8 << 20  # per message (the wire caps one at 64 MiB); an environment's spec can be large
MAX_ASSIGNMENT_BYTES = MAX_WIRE_BYTES - (64 << 10)  # one assignment, with room for the message around it
MAX_RESULTS_PER_MESSAGE = MAX_BATCH  # a worker's results travel in its outbox's batches


class WorkerLostError(SandboxError):
    """The worker running a rollout went away (crashed, killed, stopped answering)."""


class EngineMovedError(WorkerLostError):
    """A rollout that waited for its host's engine, taken off that host's workers (WorkerHub._move_waiting)."""

    def __init__(self, message: str, host: str) -> None:
        super().__init__(message)
        self.host = host


class AssignmentTooLargeError(SandboxError):
    """A rollout's assignment is larger than one message of the worker wire may be."""


@dataclass
class _Running:
    item: WorkItem
    result: asyncio.Future[tuple[EncodedRollout, float]]  # the rollout, and its run time on the worker
    budget_s: float
    sent: float  # monotonic
    deadline: float  # monotonic: past it (and its engine's wait, if it said the engine was down), the worker is stuck
    archive: str = ""  # the digest of its environment's archive, if an uploaded one


@dataclass
class _Worker:
    id: str
    host: str
    slots: int
    pid: int
    trusted: bool = False  # this host's own process (unix socket), else remote (TCP): its rollouts checked whole
    outbox: Outbox[wpb.Assignment | wpb.ControlMessage] = field(default_factory=Outbox)
    running: dict[str, _Running] = field(default_factory=dict)
    connected_at: float = field(default_factory=time.monotonic)
    next_sweep: float = field(default_factory=time.monotonic)
    served: int = 0
    # its last assignment came back as an error, invalid, or not at all within its budget (a worker that cannot load
    # an environment answers at once, so it would look the least loaded): placed on only when the others are full
    failing: bool = False
    archives: set[str] = field(default_factory=set)  # digests of the archives this stream has carried
    metrics: bytes | None = b""  # its Prometheus metrics as its heartbeats last carried them; None: too large
    # rollouts cancelled here whose worker has not yet said their sandbox is gone: (given up on at, said so)
    cancelling: dict[str, tuple[float, asyncio.Future[None]]] = field(default_factory=dict)
    acks_cancel: bool = False  # it says when a cancelled rollout's sandbox is gone (WorkerHello.acks_cancel)
    instance: str = ""  # its process's secret (WorkerHello.instance): a hello with its id reconnects only with it
    keeps_specs: bool = False  # it keeps a job's spec from the assignment that carried it (WorkerHello.keeps_specs)
    engine_wait_s: float = 0.0  # what a rollout of its may wait for its engine (WorkerHello.engine_outage_wait_s)
    engine_down: bool = False  # its engine did not answer when it last said (Heartbeat.engine_down)
    down_said_at: float = float("-inf")  # monotonic: when it last said its engine was down
    down_since: float = 0.0  # monotonic: when it first said so, of the outage it says now
    engine_waits: int = 0  # its rollouts that wait for its engine, as it last said (Heartbeat.engine_waits)
    # job id -> the spec this stream carried last (an older worker gets it every time): a job's spec of 1-2 KB went
    # with each of its assignments, the largest part of the wire's bytes and of the control plane's work to send them
    specs: dict[str, JobSpec] = field(default_factory=dict)

    @property
    def load(self) -> float:
        return (len(self.running) + len(self.cancelling)) / max(self.slots, 1)

    def says_engine_down(self, down: bool, now: float) -> None:
        """What its hello or a heartbeat says of its engine (WorkerHello/Heartbeat.engine_down)."""
        if down:
            if not self.engine_down:
                self.down_since = now
            self.down_said_at = now
        self.engine_down = down

    def acknowledged(self, assignment_id: str) -> bool:
        """Mark a cancelled rollout's sandbox gone (its worker said so, or is gone, or was waited for long enough);
        whether it was one being cancelled."""
        entry = self.cancelling.pop(assignment_id, None)
        if entry is not None and not entry[1].done():
            entry[1].set_result(None)
        return entry is not None


@dataclass(frozen=True)
class WorkerInfo:
    """A connected worker as `envfleet status` and tests see it."""

    worker_id: str
    host: str
    slots: int
    pid: int
    running: int
    served: int
    trusted: bool  # a process of this host (unix socket); a remote one's rollouts are validated whole
    engine_down: bool  # its container engine was not answering at its last heartbeat
    engine_waits: int  # its rollouts that waited for that engine then


class WorkerHub:
    """Rollout workers connected to this control plane, and the rollouts they run."""

    def __init__(
        self,
        images: ImageSource,
        *,
        heartbeat_timeout_s: float = 10.0,
        archives: ArchiveCatalog | None = None,
        result_slack_s: float = RESULT_SLACK_S,
        engine_move_after_s: float = ENGINE_MOVE_AFTER_S,
    ) -> None:
        self._images = images
        self._archives = archives or ArchiveCatalog()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.result_slack_s = result_slack_s
        self.engine_move_after_s = engine_move_after_s
        self._moving: set[str] = set()  # assignments moved off a down engine's host (_move_waiting), not yet ended
        self._workers: dict[str, _Worker] = {}
        self._joined = asyncio.Condition()
        # job id -> group id -> the worker that ran the group's first sample (by job: a job's end drops its own)
        self._group_home: dict[str, dict[str, str]] = {}
        self._tracked_groups = 0
        self._hosts_with: dict[str, set[str]] = {}  # env ref -> hosts that ran it
        self._ids = itertools.count(1)
        # a job's spec (and declarative environment) as JSON, encoded once per spec rather than per assignment
        self._encoded: dict[str, tuple[JobSpec, Environment, bytes, bytes]] = {}
        self._budgets: dict[str, dict[str, float]] = {}  # job id -> task id -> its scoring budget, asked once
        self._closed = False
        self._stopping = False  # the control plane stops (stopping())
        self.lost = 0  # workers lost so far
        self._in_use = 0  # rollouts placed (or being placed) on workers; at most the connected workers' slots
        self._slots = 0  # the connected workers' slots, summed as they join and leave
        self.waiting = 0  # rollouts waiting in _pick for a worker to connect or a slot to free
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # what placing a rollout on a worker costs it: the round trip from sending the assignment to taking the result,
        # less the rollout's own run time (the wire both ways and the waits in both processes; the recent ones)
        self.dispatch_delays: collections.deque[float] = collections.deque(maxlen=DISPATCH_SAMPLES)
        # the pids of this host's own worker processes (the control plane started them): a silent one that still
        # uses CPU is starved, not lost (see _next)
        self.local_pids: Callable[[], Collection[int]] = tuple
        # told the pid of a local worker it cut off, with a way to ask whether that pid has joined again
        self.on_local_lost: Callable[[int, Callable[[int], bool]], None] = lambda pid, rejoined: None

    @property
    def images(self) -> ImageSource:
        """The control plane's image source: it builds a job's image before the job's rollouts are placed."""
        return self._images

    @property
    def slots(self) -> int:
        """The connected workers' slots."""
        return self._slots

    @property
    def connected(self) -> int:
        """How many workers are connected (read on the metrics thread too: one len, never an iteration)."""
        return len(self._workers)

    def workers(self) -> list[WorkerInfo]:
        """The connected workers."""
        return [
            WorkerInfo(w.id, w.host, w.slots, w.pid, len(w.running), w.served, w.trusted, w.engine_down, w.engine_waits)
            for w in self._workers.values()
        ]

    def is_trusted(self, worker_id: str) -> bool:
        """Whether a connected worker of this host (unix socket) has the id."""
        w = self._workers.get(worker_id)
        return w is not None and w.trusted

    def taken(self, hello: wpb.WorkerHello) -> bool:
        """Whether the hello's id is a connected worker's that the hello cannot be the reconnect of: another
        process's (its instance differs, or says none)."""
        w = self._workers.get(hello.worker_id)
        return w is not None and (
            not hello.instance or not hmac.compare_digest(w.instance.encode(), hello.instance.encode())
        )

    async def wait_for_workers(self, n: int, timeout_s: float = 60.0) -> None:
        """Return once `n` workers are connected."""
        async with asyncio.timeout(timeout_s), self._joined:
            await self._joined.wait_for(lambda: len(self._workers) >= n)

    # -- the executor seam -------------------------------------------------------------------------------------

    async def run(self, item: WorkItem, env: Environment, spec: JobSpec) -> EncodedRollout | Rollout:
        """Run the rollout on a worker; a lost worker's rollout is retried on another (one it did not fail on, while
        there is one), within the job's budget."""
        lost: list[str] = []
        failed_on: set[str] = set()
        while True:
            worker: _Worker | None = None
            try:
                worker = await self._pick(item, env, spec, failed_on)
                try:
                    rollout = await self._run_on(worker, item, env, spec, spent=len(lost))
                finally:
                    self._free_slot()
            except AssignmentTooLargeError as e:  # no worker could take it: INFRA_ERROR at once, never retried
                return _lost_rollout(item, env, spec, [*lost, str(e)], kind=type(e).__name__)
            except WorkerLostError as e:
                if worker is not None:
                    failed_on.add(worker.id)
                if isinstance(e, EngineMovedError):  # nor on the rest of its host, which shares the down engine
                    failed_on.update(w.id for w in self._workers.values() if w.host == e.host)
                lost.append(str(e))
                if len(lost) > spec.max_infra_retries:
                    return _lost_rollout(item, env, spec, lost)
                log.warning("rollout %s: %s; retrying on another worker", item.id, e)
                continue
            return add_attempts(rollout, len(lost)) if lost else rollout

    def job_ended(self, job_id: str) -> None:
        """Tell every worker to drop the job's snapshots; forget where its groups ran."""
        self._tracked_groups -= len(self._group_home.pop(job_id, {}))
        self._encoded.pop(job_id, None)
        self._budgets.pop(job_id, None)
        for w in self._workers.values():
            w.specs.pop(job_id, None)
            w.outbox.put(wpb.ControlMessage(job_ended=wpb.JobEnded(job_id=job_id)))

    def stopping(self) -> None:
        """The control plane stops: cancelled rollouts no longer wait for their workers to say their sandboxes are
        gone."""
        self._stopping = True
        for w in self._workers.values():
            for assignment_id in list(w.cancelling):
                w.acknowledged(assignment_id)

    async def close(self) -> None:
        """End every worker's stream (workers reconnect to the next control plane) and fail what is running."""
        self._closed = True
        for w in list(self._workers.values()):
            self._drop(w, "the control plane is stopping")
        self._wake(len(self._slot_waiters))
        async with self._joined:
            self._joined.notify_all()

    # -- placement ---------------------------------------------------------------------------------------------

    async def _pick(self, item: WorkItem, env: Environment, spec: JobSpec, failed_on: set[str]) -> _Worker:
        """A worker for the rollout, once one has room, other than those it `failed_on` while there is another; the
        caller frees the slot (_free_slot) when it is done."""
        while True:
            if not self._workers:
                self.waiting += 1
                try:
                    async with asyncio.timeout(spec.rollout_timeout_s), self._joined:
                        await self._joined.wait_for(lambda: bool(self._workers) or self._closed)
                except TimeoutError:
                    raise WorkerLostError(f"no worker connected within {spec.rollout_timeout_s:g}s") from None
                finally:
                    self.waiting -= 1
            if self._closed:
                raise WorkerLostError("the control plane is stopping")
            if self._in_use < self._slots:
                break
            # every worker is full (one was lost, say): the rollout waits here, in line, rather than overload the
            # others until their heartbeats starve and they are lost too
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            self.waiting += 1
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake(1)  # the slot it was woken for goes to the next in line
                raise
            finally:
                self.waiting -= 1
        self._in_use += 1
        home = self._workers.get(self._group_home.get(item.job_id, {}).get(item.group_id, ""))
        keeper = home if home and home.load < 2.0 and not home.failing and home.id not in failed_on else None
        if keeper is not None and not keeper.engine_down:
            return keeper
        hosts = self._hosts_with.get(env.ref(), set())
        candidates: Collection[_Worker] = self._workers.values()
        if failed_on:
            candidates = [w for w in candidates if w.id not in failed_on] or candidates
        worker = min(candidates, key=lambda w: _placement(w, hosts))
        full, down, *_ = _placement(worker, hosts)
        if keeper is not None and (full or down):
            # its engine is down, and no worker whose engine answers has room: the group stays where its snapshots
            # are (one host's workers share one engine; on another down one it would wait all the same)
            return keeper
        self._remember_home(item, worker, moved=home is not None)
        return worker

    def _free_slot(self) -> None:
        self._in_use -= 1
        self._wake(1)

    def _wake(self, n: int) -> None:
        """Let the first `n` rollouts waiting for a slot try again."""
        while n > 0 and self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                n -= 1

    def _remember_home(self, item: WorkItem, worker: _Worker, moved: bool = False) -> None:
        """The group's samples go where its first went (its snapshots are there), or, `moved` from a home that
        failed or is full, where this one goes."""
        if item.group_id in self._group_home.get(item.job_id, {}):
            if moved:
                self._group_home[item.job_id][item.group_id] = worker.id
            return
        if self._tracked_groups >= MAX_TRACKED_GROUPS:  # forget the oldest job's oldest group
            oldest_job = next(iter(self._group_home))
            oldest = self._group_home[oldest_job]
            del oldest[next(iter(oldest))]
            if not oldest:
                del self._group_home[oldest_job]
            self._tracked_groups -= 1
        self._group_home.setdefault(item.job_id, {})[item.group_id] = worker.id
        self._tracked_groups += 1

    def _encode(self, job_id: str, env: Environment, spec: JobSpec) -> tuple[bytes, bytes]:
        """The job's spec and declarative environment as JSON, made again only when the spec changed (UpdatePolicy
        replaces it)."""
        cached = self._encoded.get(job_id)
        if cached is None or cached[0] is not spec:
            if cached is not None and cached[1] is env:
                env_json = cached[3]  # a policy update changes the job's spec, not its environment's (megabytes)
            else:
                env_json = env.spec.model_dump_json().encode() if isinstance(env, DeclarativeEnvironment) else b""
            cached = self._encoded[job_id] = (spec, env, spec.model_dump_json().encode(), env_json)
        return cached[2], cached[3]

    def _scoring_budget(self, item: WorkItem, env: Environment) -> float:
        budgets = self._budgets.setdefault(item.job_id, {})
        budget = budgets.get(item.task.id)
        if budget is None:
            budget = budgets[item.task.id] = scoring_budget(env, item.task)
        return budget

    async def _run_on(
        self, worker: _Worker, item: WorkItem, env: Environment, spec: JobSpec, spent: int = 0
    ) -> EncodedRollout:
        assignment_id = f"a{next(self._ids)}"
        sent = time.monotonic()
        queued_s = sent - item.enqueued_at
        future: asyncio.Future[tuple[EncodedRollout, float]] = asyncio.get_running_loop().create_future()
        archive = await self._archive_for(worker, env)
        if self._workers.get(worker.id) is not worker:  # dropped during the read: nobody would answer or expire it
            raise WorkerLostError(f"worker {worker.id} was lost")
        # the runner's own budget (every attempt and the pauses between them), and slack for the wire; the worker's
        # reader enforces it (_expire), with the runner's wait for its engine added once the worker says it is down
        each = attempt_s(spec, self._scoring_budget(item, env)) + RETRY_BACKOFF_CAP_S
        budget = (left_retries(spec, spent) + 1) * each + self.result_slack_s
        digest = archive.sha256 if archive is not None else ""
        spec_json, env_json = self._encode(item.job_id, env, spec)
        plugin = not env_json and archive is None  # the worker's own install has it: their digests must agree
        carried = worker.specs.get(item.job_id) is spec  # its spec, and its environment's, are there
        if carried:
            spec_json = env_json = b""
        assignment = wpb.Assignment(
            assignment_id=assignment_id,
            job_spec_json=spec_json,
            job_id=item.job_id,
            task_id=item.task.id,
            sample_index=item.sample_index,
            queued_s=queued_s,
            tenant=item.tenant,
            traceparent=item.traceparent,
            env_spec_json=env_json,
            env_archive=archive,
            attempts_spent=spent,
            env_digest=environment_digest(env) if plugin else "",
        )
        if (size := _assignment_size(assignment)) > MAX_ASSIGNMENT_BYTES:
            # sent, it would end the worker's stream (the wire refuses the message): every rollout there retried, and
            # this one carried on to the next worker, and the next
            worker.archives.discard(digest)
            raise AssignmentTooLargeError(
                f"the rollout's assignment is {size} bytes (the job's spec, its environment's spec and archive), over "
                f"the worker wire's {MAX_ASSIGNMENT_BYTES}: submit fewer task ids, or a smaller environment"
            )
        worker.running[assignment_id] = _Running(item, future, budget, sent, sent + budget, digest)
        if worker.keeps_specs and not carried:
            worker.specs[item.job_id] = spec
        worker.outbox.put(assignment)
        try:
            rollout, run_s = await future
        except asyncio.CancelledError:
            # CancelJob or shutdown: the worker stops the rollout and destroys its sandbox, and says so; the slot is
            # freed (and CancelJob answers) once it has, or is lost, within CANCEL_ACK_S
            acked = self._cancel(worker, assignment_id)
            # a worker that says so (an older one never does), and not while the control plane stops (its workers go
            # next, and the sweep after them): every stage of the stop has a limit of its own
            if acked is not None and worker.acks_cancel and not self._stopping:
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    async with asyncio.timeout(CANCEL_ACK_S):
                        await asyncio.shield(acked)
                worker.acknowledged(assignment_id)
            raise
        finally:
            worker.running.pop(assignment_id, None)
            self._moving.discard(assignment_id)  # its retry is placed next (run), or it ends here
        worker.served += 1
        # a rollout its host failed (its own retries spent there: the engine down, an image missing) keeps the
        # worker counted full for placement, as an error answer does: answering at once, it looked the least loaded
        # and drew the next rollouts to fail the same way
        worker.failing = rollout.status == RolloutStatus.INFRA_ERROR
        self.dispatch_delays.append(max(0.0, time.monotonic() - sent - run_s))
        self._hosts_with.setdefault(env.ref(), set()).add(worker.host)
        return rollout

    async def _archive_for(self, worker: _Worker, env: Environment) -> wpb.ArchiveEnvironment | None:
        """Which archive an uploaded environment is, with its bytes the first time this stream carries it."""
        shipped = self._archives.shipment(env)
        if shipped is None:
            return None
        m = wpb.ArchiveEnvironment(
            kind=shipped.kind,
            name=shipped.name,
            version=shipped.version,
            sha256=shipped.digest,
            rules=shipped.rules,
        )
        if shipped.digest not in worker.archives:
            data = await asyncio.to_thread(shipped.path.read_bytes)
            # checked again after the read: the first assignment queued carries the bytes, so it is the first read
            if shipped.digest not in worker.archives:
                worker.archives.add(shipped.digest)
                m.archive = data
        return m

    @staticmethod
    def _cancel(worker: _Worker, assignment_id: str) -> asyncio.Future[None] | None:
        """Stop a running rollout on its worker; the future is done once the worker says its sandbox is gone."""
        if worker.running.pop(assignment_id, None) is None:
            return None
        worker.outbox.put(wpb.ControlMessage(cancel=wpb.Cancel(assignment_id=assignment_id)))
        acked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        worker.cancelling[assignment_id] = (time.monotonic() + CANCEL_ACK_S, acked)
        return acked

    # -- the worker's stream -----------------------------------------------------------------------------------

    async def attach(
        self, hello: wpb.WorkerHello, inbound: AsyncIterator[wpb.WorkerMessage], *, trusted: bool
    ) -> AsyncIterator[wpb.ControlMessage]:
        """Serve one worker's stream: yields what to send it; returns (ending the stream) when it is lost. A
        `trusted` worker is a process of this host; its rollouts are checked less (orchestrator/worker/results.py)."""
        if self._closed:
            return
        worker = _Worker(hello.worker_id, hello.host, max(hello.slots, 1), hello.pid, trusted)
        worker.acks_cancel = hello.acks_cancel
        worker.keeps_specs = hello.keeps_specs
        worker.instance = hello.instance
        worker.engine_wait_s = hello.engine_outage_wait_s
        # before its first heartbeat: the rollouts woken below are placed now
        worker.says_engine_down(hello.engine_down, time.monotonic())
        previous = self._workers.get(worker.id)
        if previous is not None:
            self._drop(previous, "it connected again")
        self._workers[worker.id] = worker
        self._slots += worker.slots
        log.info("worker %s joined (host %s, pid %d, %d slots)", worker.id, worker.host, worker.pid, worker.slots)
        self._wake(worker.slots)
        reader: asyncio.Task[None] | None = None
        try:
            # within the try: a Connect cancelled while it waits for the lock (just after another worker joined)
            # left the worker registered, its slots counted and picked first, with nobody reading its outbox
            async with self._joined:
                self._joined.notify_all()
            reader = asyncio.create_task(self._read(worker, inbound), name=f"worker {worker.id} reader")
            while True:
                batch = await worker.outbox.get()
                if not batch:
                    return
                for message in _control_messages(batch):
                    yield message
        finally:
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
            self._drop(worker, "its stream ended")

    async def _next(self, worker: _Worker, inbound: AsyncIterator[wpb.WorkerMessage]) -> wpb.WorkerMessage | None:
        """The worker's next message; TimeoutError after `heartbeat_timeout_s` of silence, counted in time this
        process was awake to hear it: a stall of the control plane's own loop (its host starved of CPU, a long
        callback) counts at most HEARD_TICK_S x 1.5 a tick, so it never cuts off every worker at once.

        A silent worker that is a process of this host, running and using CPU over its silence, is starved rather
        than lost (on a host at a load of 100, heartbeats arrive late from workers that still work). Dropping it
        would retry its rollouts and destroy their sandboxes, which is how a loaded host collapses; it is given
        another `heartbeat_timeout_s` instead, and its rollouts stay bound by their budgets, up to STARVED_CUTOFFS
        of them in a row: silent that long, its loop is stuck however much CPU it uses (a loop in an environment's
        own synchronous code), and it is lost (this host's supervisor starts another). A stopped (SIGSTOP), hung
        (no CPU) or gone one is lost, as is a silent remote one."""
        pending = asyncio.ensure_future(anext(inbound, None))
        loop = asyncio.get_running_loop()
        silent = 0.0
        starved = 0  # cut-offs it was kept past, in a row
        cpu: int | None = None  # the worker process's CPU when its silence began (a process of this host only)
        try:
            while True:
                t0 = loop.time()
                done, _ = await asyncio.wait((pending,), timeout=HEARD_TICK_S)
                if done:
                    return pending.result()
                fresh = cpu is None  # taken now: its progress is judged from the next tick on
                if fresh:
                    cpu = self._local_cpu(worker)
                silent += min(loop.time() - t0, 1.5 * HEARD_TICK_S)
                if silent >= self.heartbeat_timeout_s:
                    now = self._local_cpu(worker)
                    if cpu is None or now is None:
                        raise TimeoutError
                    if fresh:
                        continue
                    starved += 1
                    if now <= cpu:
                        raise TimeoutError
                    if starved >= STARVED_CUTOFFS:
                        raise TimeoutError(
                            f"silent for {starved} cut-offs in a row, though its process uses CPU: stuck"
                        )
                    log.warning(
                        "worker %s (pid %d) silent for %gs, but its process runs and uses CPU: starved, kept",
                        worker.id,
                        worker.pid,
                        silent,
                    )
                    self._expire(worker, time.monotonic())
                    silent, cpu = 0.0, now
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending

    async def _read(self, worker: _Worker, inbound: AsyncIterator[wpb.WorkerMessage]) -> None:
        why = "its stream ended"
        try:
            while True:
                message = await self._next(worker, inbound)
                if message is None:
                    break
                if message.HasField("results"):
                    results = message.results.results
                    if len(results) > MAX_RESULTS_PER_MESSAGE:
                        # a worker sends a result an assignment, at most an outbox's batch a message: 13 million
                        # empty ones in one 64 MiB message held the loop for seconds, and could come again
                        raise InvalidResultError(
                            f"it sent {len(results)} results in one message, over {MAX_RESULTS_PER_MESSAGE}"
                        )
                    for result in results:
                        self._deliver(worker, result)
                elif message.HasField("heartbeat"):
                    self._take_heartbeat(worker, message.heartbeat)
                now = time.monotonic()
                if now >= worker.next_sweep:  # heartbeats come every second or so: the sweep runs as often
                    worker.next_sweep = now + OVERDUE_SWEEP_S
                    self._expire(worker, now)
        except TimeoutError as e:
            why = str(e) or f"no heartbeat for {self.heartbeat_timeout_s:g}s"
        except InvalidResultError as e:
            why = str(e)
        except Exception as e:  # the connection broke
            why = f"its stream failed: {type(e).__name__}"
        self._drop(worker, why)

    def _take_heartbeat(self, worker: _Worker, beat: wpb.Heartbeat) -> None:
        now = time.monotonic()
        worker.says_engine_down(beat.engine_down, now)
        # the rollouts of its own it names (a group's home runs up to twice its slots): those of another worker, or
        # names past that, are not read
        names = set(beat.engine_waits[: 2 * worker.slots]) if beat.engine_down else set()
        waiting = [a for a, r in worker.running.items() if r.item.id in names and not r.result.done()]
        worker.engine_waits = len(waiting)
        if waiting and now - worker.down_since >= self.engine_move_after_s:
            self._move_waiting(worker, waiting)
        if beat.metrics:
            self._take_metrics(worker, beat.metrics)

    def _move_waiting(self, worker: _Worker, assignment_ids: list[str]) -> None:
        """Fail over rollouts that wait on `worker` for its engine to workers of other hosts whose engine answers,
        as many as those have room for (less what earlier moves took and have not yet been placed): each would wait
        up to engine_outage_wait_s (5 minutes by default) and hold its slot, and a training step waits for its
        slowest rollout. One host's workers share one engine, so the move is off the whole host (EngineMovedError).
        Each counts one lost attempt, as a lost worker's rollout does."""
        room = -len(self._moving) + sum(
            max(0, w.slots - len(w.running) - len(w.cancelling))
            for w in self._workers.values()
            if w.host != worker.host and not w.engine_down and not w.failing
        )
        moving = assignment_ids[: max(room, 0)]
        for assignment_id in moving:
            message = f"worker {worker.id}'s engine is down: moved to a host whose engine answers"
            worker.running[assignment_id].result.set_exception(EngineMovedError(message, worker.host))
            self._cancel(worker, assignment_id)
        self._moving.update(moving)
        if moving:
            log.info("moved %d rollouts waiting for worker %s's engine to other hosts", len(moving), worker.id)

    def _local_cpu(self, worker: _Worker) -> int | None:
        if not worker.trusted or worker.pid not in self.local_pids():
            return None
        return cpu_ticks(worker.pid)

    @staticmethod
    def _take_metrics(worker: _Worker, text: bytes) -> None:
        if len(text) <= MAX_SNAPSHOT_BYTES:
            worker.metrics = text
        elif worker.metrics is not None:  # said once per worker, not at every snapshot
            log.warning(
                "worker %s sent %d bytes of metrics, over %d; dropped", worker.id, len(text), MAX_SNAPSHOT_BYTES
            )
            worker.metrics = None

    def metric_snapshots(self) -> list[tuple[str, str, bytes]]:
        """The connected workers' metrics as they last sent them: (worker id, host, Prometheus text). Safe to call
        from another thread (a metrics scrape)."""
        return [(w.id, w.host, w.metrics) for w in list(self._workers.values()) if w.metrics]

    def _deliver(self, worker: _Worker, result: wpb.RolloutResult) -> None:
        if worker.acknowledged(result.assignment_id) or result.cancelled:
            return  # a cancelled rollout's end (its sandbox is gone), or its result, late: discarded
        running = worker.running.pop(result.assignment_id, None)
        if running is None or running.result.done():
            return  # cancelled, or given up on: the answer is late
        if result.error:
            worker.failing = True
            if running.archive:
                # its environment's archive may be what failed there (it did not load): the next assignment of it
                # to this worker carries the bytes again, and the worker loads them again
                worker.archives.discard(running.archive)
            worker.specs.pop(running.item.job_id, None)  # and the job's spec, whatever the worker did not keep
            running.result.set_exception(WorkerLostError(result.error))
            return
        try:
            running.result.set_result(decode(result, running.item, trusted=worker.trusted))
        except Exception as e:  # a check's own failure too: taken off `running`, the rollout would wait for ever
            if isinstance(e, InvalidResultError):
                log.warning("worker %s sent an invalid rollout for %s: %s", worker.id, running.item.id, e)
            else:
                log.error("checking worker %s's rollout for %s failed", worker.id, running.item.id, exc_info=e)
            worker.failing = True
            running.result.set_exception(WorkerLostError(f"worker {worker.id} sent an invalid rollout: {e}"))

    def _expire(self, worker: _Worker, now: float) -> None:
        """Give up on the worker's rollouts past their budget: each fails over, and is stopped on the worker (a
        stuck rollout holds a sandbox there)."""
        for assignment_id, running in list(worker.running.items()):
            # its runner waits for an engine that does not answer (engine_outage_wait_s): counted in only for a
            # rollout its worker said so during, else a stuck rollout was given up that much later, 5 minutes by default
            waited = worker.engine_wait_s if worker.engine_down or worker.down_said_at >= running.sent else 0.0
            if now > running.deadline + waited and not running.result.done():
                worker.failing = True
                running.result.set_exception(
                    WorkerLostError(f"worker {worker.id} gave no result within {running.budget_s + waited:g}s")
                )
                self._cancel(worker, assignment_id)
        for assignment_id, (give_up_at, _) in list(worker.cancelling.items()):
            if now > give_up_at:
                worker.acknowledged(assignment_id)  # a worker that never says (stuck, or older) frees it at last

    def _drop(self, worker: _Worker, why: str) -> None:
        """Forget a worker: its rollouts fail over, its stream ends."""
        if self._workers.get(worker.id) is not worker:
            return
        del self._workers[worker.id]
        self._slots -= worker.slots
        if all(w.host != worker.host for w in self._workers.values()):
            # the images a host had count while it has a worker: hosts come and go for good in an autoscaled fleet
            for ref, hosts in list(self._hosts_with.items()):
                hosts.discard(worker.host)
                if not hosts:  # and an environment no host has any more is forgotten (one a version, for ever)
                    del self._hosts_with[ref]
        self.lost += 0 if self._closed else 1
        if not self._closed:
            log.warning(
                "worker %s (pid %d) lost: %s; %d rollout(s) to retry", worker.id, worker.pid, why, len(worker.running)
            )
        for running in worker.running.values():
            if not running.result.done():
                running.result.set_exception(WorkerLostError(f"worker {worker.id} was lost: {why}"))
        worker.running.clear()
        for assignment_id in list(worker.cancelling):
            worker.acknowledged(assignment_id)  # its sandboxes are the sweep's now
        worker.outbox.close()
        if not self._workers:
            # rollouts waiting for a slot wait for a worker now: in time (_pick), not for a slot that no end frees
            self._wake(len(self._slot_waiters))
        if not self._closed and worker.trusted and worker.pid in self.local_pids():
            self.on_local_lost(worker.pid, self._connected_pid)

    def _connected_pid(self, pid: int) -> bool:
        """Whether a process of this host with `pid` is connected: a remote worker's pid is its own host's (and
        whatever its hello says), so it never stands for a local one."""
        return any(w.trusted and w.pid == pid for w in self._workers.values())


def _placement(worker: _Worker, hosts: set[str]) -> tuple[bool, bool, float, bool, int]:
    """A worker's rank for a new rollout, the lowest first: one with room (a failing worker counted as full) whose
    engine answers (a rollout on one whose engine is down waits for it, up to minutes, while another host could run
    it now), then the least loaded; among equals, one whose host already has the image."""
    load = round(worker.load + worker.failing, 3)
    return load >= 1.0, worker.engine_down, load, worker.host not in hosts, worker.served


def _assignment_size(a: wpb.Assignment) -> int:
    archive = len(a.env_archive.archive) if a.HasField("env_archive") else 0  # an archive's first trip carries it
    return len(a.job_spec_json) + len(a.env_spec_json) + archive + 256  # and its short fields


def _control_messages(batch: list[wpb.Assignment | wpb.ControlMessage]) -> list[wpb.ControlMessage]:
    """Assignments next to each other travel in one message."""
    return as_messages(
        batch,
        wpb.Assignment,
        lambda run: wpb.ControlMessage(assign=wpb.AssignmentBatch(assignments=run)),
        _assignment_size,
        MAX_ASSIGN_BYTES,
    )


def _lost_rollout(
    item: WorkItem, env: Environment, spec: JobSpec, lost: list[str], kind: str = WorkerLostError.__name__
) -> Rollout:
    """The rollout of an item whose workers were all lost: INFRA_ERROR, delivered so the trainer can mask it."""
    error = RolloutError(kind=kind, message="; ".join(lost)[-2000:])
    return unrun_rollout(item, env.ref(), spec.policy.version, error, attempts=len(lost))
