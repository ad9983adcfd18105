"""Admission and fair share: which job's next work item runs when a slot frees.

Admission is by host capacity: a rollout starts only while the sandboxes in flight, their CPU quotas and their
memory limits fit the configured capacity (with overcommit: sandboxes mostly wait on the policy). A job whose single
sandbox could never fit is refused (CapacityError, RESOURCE_EXHAUSTED); a job that fits but finds the host full is
queued. Each job also has its own cap. Fair share is per tenant first, then per job: the tenant with the fewest
running rollouts goes next (so one tenant's many priority-100 jobs cannot starve another tenant), and among that
tenant's jobs with work and room, the one with the fewest running rollouts per unit of priority (weighted fair
share). Priority weighs a tenant's jobs against each other, never against another tenant's.

Sessions and raw sandboxes count against the same capacity: `reserve(need)` takes a sandbox's share now (or refuses
with RESOURCE_EXHAUSTED when the host is full, since a trainer waiting on Reset is better told than queued), and the
returned `Reservation` gives it back when the sandbox ends.

A tenant whose rollouts need more of the host than another's is not passed over for good: while the fairest
tenant's next rollout does not fit, smaller ones of other tenants fill the room (backfill) for at most
DRAIN_AFTER_S, and then nothing else starts until it fits (as long as the host, empty of rollouts, would hold it).
Before, each freed CPU went to whichever tenant fitted it at once, and a tenant of 4-CPU sandboxes beside one of
1-CPU sandboxes never ran. Tenants tied on running rollouts take turns (least recently served first).

Placement is image-aware: a job whose sandbox image is still being built is held back (`ready=False`), so its
rollouts do not sit on slots waiting for a build while jobs whose images exist could run; `set_ready` releases it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
from collections.abc import Callable, Collection, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.core.environment import Task
from orchestrator.core.errors import BusyError, CapacityError
from orchestrator.core.models import rollout_id
from orchestrator.rollout.runner import WorkItem
from orchestrator.service.tenancy import LOCAL_TENANT

log = logging.getLogger(__name__)

DRAIN_AFTER_S = 10.0  # how long other tenants' rollouts may backfill the room a fairer tenant's rollout waits for


class Capacity(BaseModel):
    """What this host may run at once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sandboxes: int = Field(1024, ge=1, le=100_000)
    cpus: float = Field(default_factory=lambda: float(os.cpu_count() or 1) * 16, gt=0, description="CPU quota sum")
    memory_mb: int = Field(default_factory=lambda: _host_memory_mb() * 2, gt=0, description="memory limit sum")
    # sessions and raw sandboxes hold their share until they end (a TTL of up to a day): with nothing per tenant,
    # one tenant's idle sandboxes took the whole host, and every other tenant's jobs queued and its sessions were
    # refused for as long as it kept them. A server without tokens has one user (tenant "local"), not held to it
    tenant_share: float = Field(
        0.5, gt=0, le=1, description="the most of each of the above one tenant's sessions and raw sandboxes hold"
    )


def _host_memory_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return 4096


@dataclass(frozen=True)
class Need:
    """What one rollout of a job reserves while it runs."""

    cpus: float = 0.0
    memory_mb: int = 0


class PendingItems:
    """A job's work items, made as they start rather than all at its submit: a job of a million rollouts was a
    million items built on the event loop (1.5 s, 160 MB) at each SubmitJob, and a tenant could submit and cancel
    such jobs at will. Items come task by task, each task's samples in a row, as a list of them would; `extend` puts
    items made elsewhere behind the rest, as a list's would. `skip`: ids not to run (a resumed job's logged ones)."""

    def __init__(
        self,
        job_id: str = "",
        tasks: Sequence[Task] = (),
        group_size: int = 1,
        *,
        enqueued_at: float = 0.0,
        tenant: str = "",
        skip: Collection[str] = (),
    ) -> None:
        self._job_id, self._tasks, self._group_size = job_id, tasks, group_size
        self._enqueued_at, self._tenant, self._skip = enqueued_at, tenant, skip
        self._tail: collections.deque[WorkItem] = collections.deque()  # made elsewhere, after the tasks' items
        self._next = 0  # the next item's place among the tasks' samples, in order
        skipped = sum(1 for t in tasks for k in range(group_size) if rollout_id(job_id, t.id, k) in skip) if skip else 0
        self._left = len(tasks) * group_size - skipped  # not made yet, skips left out

    def __len__(self) -> int:
        return self._left + len(self._tail)

    def __bool__(self) -> bool:
        return self._left > 0 or bool(self._tail)

    def extend(self, items: Iterable[WorkItem]) -> None:
        """Queue items made elsewhere, behind those not made yet."""
        if isinstance(items, PendingItems):  # not iterable: made as they start, they are popped, never walked
            raise TypeError("pending items are queued behind others item by item (add_job makes them)")
        self._tail.extend(items)

    def popleft(self) -> WorkItem:
        """The next item; IndexError when none is left."""
        while self._left > 0:
            task, k = divmod(self._next, self._group_size)
            self._next += 1
            item = WorkItem(self._job_id, self._tasks[task], k, self._enqueued_at, self._tenant)
            if not self._skip or item.id not in self._skip:
                self._left -= 1
                return item
        if self._tail:
            return self._tail.popleft()
        raise IndexError("no pending work item is left")

    def clear(self) -> None:
        """Drop every pending item."""
        self._tail.clear()
        self._left = 0


@dataclass
class JobQueue:
    """One job's pending work and its share."""

    job_id: str
    priority: int
    max_concurrency: int
    need: Need = Need()
    ready: bool = True  # False while the job's image is being built
    tenant: str = ""
    pending: PendingItems = field(default_factory=PendingItems)
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def has_room(self) -> bool:
        return self.ready and bool(self.pending) and len(self.running) < self.max_concurrency


class Reservation:
    """Host capacity held by a session or a raw sandbox; `release()` (idempotent) gives it back."""

    def __init__(self, scheduler: Scheduler, need: Need, tenant: str) -> None:
        self._scheduler = scheduler
        self.need = need
        self.tenant = tenant
        self._released = False

    def release(self) -> None:
        """Give the capacity back (once)."""
        if not self._released:
            self._released = True
            self._scheduler._unreserve(self.need, self.tenant)


class Scheduler:
    """Starts `run(item)` for queued items within the caps; call `kick()` after enqueueing."""

    def __init__(
        self,
        max_in_flight: int,
        run: Callable[[WorkItem], Coroutine[Any, Any, None]],
        capacity: Capacity | None = None,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.capacity = capacity or Capacity()
        self._run = run
        self._cpus_used = 0.0
        self._memory_used = 0
        self._held = 0  # sandboxes of sessions and the raw sandbox API, reserved outside the queues
        self._held_by: dict[str, Need] = {}  # what each tenant's of them hold (capacity.tenant_share)...
        self._held_count: dict[str, int] = {}  # ...and how many
        # whether capacity.tenant_share holds: with tokens (the server sets it); without, its one user has the host
        self.tenant_shares = False
        self._held_cpus = 0.0  # and their share, which no drain frees
        self._held_memory = 0
        self._starts = 0  # rollouts started so far: a tenant's last start orders the ties
        self._served: dict[str, int] = {}  # tenant -> its last start
        self._blocked: dict[str, float] = {}  # tenant -> since when its next rollout found no room
        self._running = 0  # kept as a count: summing over the queues made each decision O(jobs), a burst O(jobs^2)
        self._running_by_tenant: collections.Counter[str] = collections.Counter()  # counted for the same reason
        self._queues: dict[str, JobQueue] = {}
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return self._running

    # the gauges read these at a scrape, on the metrics server's thread: a copy of the dict's values first (one C
    # call the event loop cannot cut into); iterated live, a queue added meanwhile was "dictionary changed size
    # during iteration", and prometheus_client answered the whole page with a 500
    @property
    def queue_depth(self) -> int:
        return sum(len(q.pending) for q in list(self._queues.values()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="scheduler")
        self._task.add_done_callback(_stopped)

    def on_failure(self, listener: Callable[[], None]) -> None:
        """Call `listener()` if the scheduler's loop ends by an error: from then on no rollout starts."""
        if self._task is not None:
            self._task.add_done_callback(lambda t: None if t.cancelled() or t.exception() is None else listener())

    def check_fits(self, need: Need) -> None:
        """Refuse, with the numbers, a rollout that could never be admitted on this host."""
        cap = self.capacity
        if need.cpus > cap.cpus or need.memory_mb > cap.memory_mb:
            raise CapacityError(
                f"one sandbox needs {need.cpus:g} CPUs and {need.memory_mb} MB, but this host's capacity is "
                f"{cap.cpus:g} CPUs and {cap.memory_mb} MB in all; lower the environment's limits or raise capacity"
            )

    @property
    def waiting_for_images(self) -> int:
        """Queued rollouts held back until their image is built."""
        return sum(len(q.pending) for q in list(self._queues.values()) if not q.ready)  # a scrape's: a copy

    def add_job(
        self,
        job_id: str,
        priority: int,
        max_concurrency: int,
        items: PendingItems | Iterable[WorkItem],
        need: Need = Need(),
        *,
        ready: bool = True,
        tenant: str = "",
    ) -> None:
        """Queue a job of `tenant` (its items as made, or as PendingItems that make them as they start); with
        `ready=False` none of its items starts before `set_ready(job_id)`."""
        self.check_fits(need)
        q = self._queues.get(job_id)
        if q is None and isinstance(items, PendingItems):
            q = self._queues[job_id] = JobQueue(job_id, priority, max_concurrency, need, ready, tenant, items)
        else:
            if q is None:
                q = self._queues[job_id] = JobQueue(job_id, priority, max_concurrency, need, ready, tenant)
            if items is q.pending:
                raise ValueError(f"job {job_id}'s pending items are queued already")
            if isinstance(items, PendingItems):  # a second batch for a queued job: made now, behind the first
                items = [items.popleft() for _ in range(len(items))]
            q.pending.extend(items)
        self.kick()

    def set_ready(self, job_id: str) -> None:
        """The job's image exists: its items may start."""
        q = self._queues.get(job_id)
        if q is not None and not q.ready:
            q.ready = True
            self.kick()

    def running_of(self, job_id: str) -> int:
        q = self._queues.get(job_id)
        return len(q.running) if q else 0

    def pending_of(self, job_id: str) -> int:
        q = self._queues.get(job_id)
        return len(q.pending) if q else 0

    async def cancel_job(self, job_id: str) -> None:
        """Drop a job's pending items and cancel its running ones (their sandboxes are destroyed)."""
        await asyncio.gather(*self.drop_job(job_id), return_exceptions=True)

    def drop_job(self, job_id: str) -> list[asyncio.Task[None]]:
        """Drop a job's pending items and cancel its running ones, at once; returns those, to await their end (their
        sandboxes destroyed)."""
        q = self._queues.pop(job_id, None)
        if q is None:
            return []
        q.pending.clear()
        if not any(o.tenant == q.tenant for o in self._queues.values()):
            self._blocked.pop(q.tenant, None)  # a wait of the tenant's it never ran: none to count on
        tasks = list(q.running.values())
        # their done callbacks still release the counts: the queue is found through the callback, not the dict
        for t in tasks:
            t.cancel()
        return tasks

    def kick(self) -> None:
        self._kick.set()

    def _fits(self, need: Need) -> bool:
        return self.in_flight < self.max_in_flight and self._room(need)

    def _room(self, need: Need) -> bool:
        cap = self.capacity
        return (
            self._running + self._held < cap.max_sandboxes
            and self._cpus_used + need.cpus <= cap.cpus
            and self._memory_used + need.memory_mb <= cap.memory_mb
        )

    @property
    def reserved(self) -> int:
        """Sandboxes held through `reserve` now."""
        return self._held

    def reserve(self, need: Need, what: str, tenant: str = LOCAL_TENANT) -> Reservation:
        """Take one sandbox's share of the host now for `what` (a session, a raw sandbox) of `tenant`;
        BusyError (with the numbers) when the host is full, or the tenant holds its share of it
        (capacity.tenant_share). Release the returned Reservation when the sandbox ends."""
        self.check_fits(need)
        held = self._held_by.get(tenant, Need())
        count = self._held_count.get(tenant, 0)
        cap, share = self.capacity, self.capacity.tenant_share
        # a tenant's first sandbox is never refused for its share: a share too small for one (max_sandboxes 1) would
        # refuse every tenant for good, holding nothing
        if (
            self.tenant_shares
            and count
            and (
                count + 1 > share * cap.max_sandboxes
                or held.cpus + need.cpus > share * cap.cpus
                or held.memory_mb + need.memory_mb > share * cap.memory_mb
            )
        ):
            raise BusyError(
                f"{what} cannot start: your sessions and sandboxes hold {count} sandboxes, {held.cpus:g} CPUs and "
                f"{held.memory_mb} MB, and with this one ({need.cpus:g} CPUs, {need.memory_mb} MB) would pass "
                f"capacity.tenant_share = {share:g} of this host ({cap.max_sandboxes} sandboxes, {cap.cpus:g} CPUs, "
                f"{cap.memory_mb} MB); close some"
            )
        if not self._room(need):
            cap = self.capacity
            raise BusyError(
                f"this host is at capacity, {what} cannot start now: {self._running + self._held} of "
                f"capacity.max_sandboxes = {cap.max_sandboxes} sandboxes, {self._cpus_used:g} + {need.cpus:g} of "
                f"capacity.cpus = {cap.cpus:g} CPUs, {self._memory_used} + {need.memory_mb} of "
                f"capacity.memory_mb = {cap.memory_mb} MB; try again later"
            )
        self._held += 1
        self._held_cpus += need.cpus
        self._held_memory += need.memory_mb
        self._cpus_used += need.cpus
        self._memory_used += need.memory_mb
        self._held_by[tenant] = Need(held.cpus + need.cpus, held.memory_mb + need.memory_mb)
        self._held_count[tenant] = count + 1
        return Reservation(self, need, tenant)

    def _unreserve(self, need: Need, tenant: str) -> None:
        count = self._held_count.pop(tenant, 0) - 1
        held = self._held_by.pop(tenant, Need())
        if count > 0:  # a tenant that holds nothing is forgotten
            self._held_count[tenant] = count
            self._held_by[tenant] = Need(max(0.0, held.cpus - need.cpus), max(0, held.memory_mb - need.memory_mb))
        self._held = max(0, self._held - 1)
        self._held_cpus = max(0.0, self._held_cpus - need.cpus)
        self._held_memory = max(0, self._held_memory - need.memory_mb)
        self._give_back(need)
        self.kick()  # queued rollouts may fit now

    def _give_back(self, need: Need) -> None:
        self._cpus_used = max(0.0, self._cpus_used - need.cpus)
        self._memory_used = max(0, self._memory_used - need.memory_mb)
        if not self._running and not self._held:
            # fractions of a CPU added and taken away leave a rounding residue (1e-15): with nothing running it is
            # 0, and a rollout that needs the whole host fits again (it was refused, or queued for good)
            self._cpus_used, self._held_cpus = 0.0, 0.0

    def _could_fit(self, need: Need) -> bool:
        """Whether `need` fits once every running rollout has ended (what held reservations leave)."""
        cap = self.capacity
        return (
            self._held < cap.max_sandboxes
            and self._held_cpus + need.cpus <= cap.cpus
            and self._held_memory + need.memory_mb <= cap.memory_mb
        )

    def _next(self) -> JobQueue | None:
        if self.in_flight >= self.max_in_flight:
            return None
        if len(self._queues) == 1:  # one job queued (a trainer's usual): no share to weigh
            q = next(iter(self._queues.values()))
            return q if q.has_room() and self._room(q.need) else None
        # by tenant in one pass: gathered again for each tenant, a decision with every tenant blocked was tenants x
        # queues (56 ms at 200 tenants of 64 jobs each), and one is made at each rollout's end
        waiting: dict[str, list[JobQueue]] = {}
        for q in self._queues.values():
            if q.has_room():
                waiting.setdefault(q.tenant, []).append(q)
        if not waiting:
            return None
        # what a tenant holds counts its sessions and raw sandboxes too: by its rollouts alone, one that held its
        # share in sessions got as much again of what was left for jobs
        running, held, served = self._running_by_tenant, self._held_count, self._served
        tenants = sorted(waiting, key=lambda t: (running[t] + held.get(t, 0), served.get(t, -1)))
        now = asyncio.get_running_loop().time()
        for tenant in tenants:  # the fairest first; the next ones backfill while it waits for room
            mine = waiting[tenant]
            fit = [q for q in mine if self._room(q.need)]
            if fit:
                self._blocked.pop(tenant, None)
                return min(fit, key=lambda q: (len(q.running) / q.priority, -q.priority))
            since = self._blocked.setdefault(tenant, now)
            if now - since >= DRAIN_AFTER_S and any(self._could_fit(q.need) for q in mine):
                return None  # its wait is over: the host drains for it
        return None

    def running_by_tenant(self) -> dict[str, int]:
        """Running rollouts per tenant."""
        return {t: n for t, n in self._running_by_tenant.items() if n}

    async def _loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            while (q := self._next()) is not None:
                item = q.pending.popleft()
                self._cpus_used += q.need.cpus
                self._memory_used += q.need.memory_mb
                task = asyncio.create_task(self._run(item), name=f"rollout {item.id}")
                q.running[item.id] = task
                self._running += 1
                self._running_by_tenant[q.tenant] += 1
                self._starts += 1
                self._served[q.tenant] = self._starts
                task.add_done_callback(functools.partial(self._done, q, item.id))

    def _done(self, q: JobQueue, rid: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (e := task.exception()) is not None:  # a bug: said here, not at collection
            log.error("rollout %s failed outside its attempts", rid, exc_info=e)
        if q.running.pop(rid, None) is not None:
            self._running -= 1
            self._running_by_tenant[q.tenant] -= 1
            if not self._running_by_tenant[q.tenant]:
                del self._running_by_tenant[q.tenant]
        self._give_back(q.need)
        if not q.pending and not q.running:
            self._queues.pop(q.job_id, None)
            if not any(o.tenant == q.tenant for o in self._queues.values()):
                self._blocked.pop(q.tenant, None)
                if not self._running_by_tenant[q.tenant]:
                    self._served.pop(q.tenant, None)
        self.kick()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        tasks = [t for q in self._queues.values() for t in q.running.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._queues.clear()
        self._running = 0


def _stopped(task: asyncio.Task[None]) -> None:
    """Said when it happens, not at shutdown: with the scheduler's loop gone no rollout starts."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.critical("the scheduler stopped: no rollout starts until the process restarts", exc_info=e)
