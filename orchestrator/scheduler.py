"""Admission and fair share: which job's next work item runs when a slot frees.

A global cap bounds rollouts in flight on this host; each job has its own cap; among jobs with work and room, the
one with the fewest running rollouts per unit of priority goes next (weighted fair share).
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from orchestrator.rollout.runner import WorkItem


@dataclass
class JobQueue:
    """One job's pending work and its share."""

    job_id: str
    priority: int
    max_concurrency: int
    pending: collections.deque[WorkItem] = field(default_factory=collections.deque)
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def has_room(self) -> bool:
        return bool(self.pending) and len(self.running) < self.max_concurrency


class Scheduler:
    """Starts `run(item)` for queued items within the caps; call `kick()` after enqueueing."""

    def __init__(self, max_in_flight: int, run: Callable[[WorkItem], Coroutine[Any, Any, None]]) -> None:
        self.max_in_flight = max_in_flight
        self._run = run
        self._queues: dict[str, JobQueue] = {}
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return sum(len(q.running) for q in self._queues.values())

    @property
    def queue_depth(self) -> int:
        return sum(len(q.pending) for q in self._queues.values())

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="scheduler")

    def add_job(self, job_id: str, priority: int, max_concurrency: int, items: list[WorkItem]) -> None:
        q = self._queues.setdefault(job_id, JobQueue(job_id, priority, max_concurrency))
        q.pending.extend(items)
        self.kick()

    def running_of(self, job_id: str) -> int:
        q = self._queues.get(job_id)
        return len(q.running) if q else 0

    def pending_of(self, job_id: str) -> int:
        q = self._queues.get(job_id)
        return len(q.pending) if q else 0

    async def cancel_job(self, job_id: str) -> None:
        """Drop a job's pending items and cancel its running ones (their sandboxes are destroyed)."""
        q = self._queues.pop(job_id, None)
        if q is None:
            return
        q.pending.clear()
        tasks = list(q.running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def kick(self) -> None:
        self._kick.set()

    def _next(self) -> JobQueue | None:
        ready = [q for q in self._queues.values() if q.has_room()]
        if not ready:
            return None
        return min(ready, key=lambda q: (len(q.running) / q.priority, -q.priority))

    async def _loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            while self.in_flight < self.max_in_flight and (q := self._next()) is not None:
                item = q.pending.popleft()
                task = asyncio.create_task(self._run(item), name=f"rollout {item.id}")
                q.running[item.id] = task
                task.add_done_callback(functools.partial(self._done, q, item.id))

    def _done(self, q: JobQueue, rid: str, _task: asyncio.Task[None]) -> None:
        q.running.pop(rid, None)
        if not q.pending and not q.running:
            self._queues.pop(q.job_id, None)
        self.kick()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        tasks = [t for q in self._queues.values() for t in q.running.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._queues.clear()
