"""Prepared snapshots for groups: when a task's setup is expensive, the first sample of a group runs it and
snapshots the workspace (a tar through envd, the equivalent of `docker commit` for a tmpfs workspace); the other
samples of the group restore the snapshot instead of repeating the setup. Snapshots are dropped when the job ends.

What a snapshot holds is the workspace: a setup that must also leave state elsewhere does not declare itself
snapshot-able.

Snapshots are held in the orchestrator's memory, so they are bounded: one snapshot is read no further than
`max_bytes` (counted as it streams out of envd), and a job holds at most `per_job_count` snapshots and
`per_job_bytes` in all. A group whose snapshot would pass a bound is not snapshotted: its samples each run the
setup, as without snapshots (slower, never wrong).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from orchestrator.core.errors import ArchiveTooLargeError
from orchestrator.core.sandbox import Sandbox

log = logging.getLogger(__name__)

Outcome = Literal["built", "restored", "fallback"]


@dataclass(frozen=True)
class SnapshotBudget:
    """How much snapshot data the orchestrator holds: per snapshot, and per job in count and bytes."""

    max_bytes: int = 256 << 20
    per_job_count: int = 256
    per_job_bytes: int = 1 << 30


class SnapshotCache:
    """Workspace snapshots keyed by (job id, task id), built once per group, within a SnapshotBudget."""

    def __init__(self, budget: SnapshotBudget | None = None) -> None:
        self.budget = budget or SnapshotBudget()
        self._snapshots: dict[tuple[str, str], asyncio.Future[bytes]] = {}
        self._count: collections.Counter[str] = collections.Counter()  # per job: snapshots held or being built
        self._bytes: collections.Counter[str] = collections.Counter()  # per job: bytes held

    def __len__(self) -> int:
        return len(self._snapshots)

    def held_bytes(self, job_id: str) -> int:
        """Bytes of the job's snapshots held now."""
        return self._bytes[job_id]

    def _room(self, job_id: str) -> int:
        """The most the next snapshot of the job may be (0: the job's budget is spent)."""
        b = self.budget
        if self._count[job_id] >= b.per_job_count:
            return 0
        return max(0, min(b.max_bytes, b.per_job_bytes - self._bytes[job_id]))

    async def _snapshot(self, key: tuple[str, str], sandbox: Sandbox, workspace: str) -> bytes:
        room = self._room(key[0])
        if room <= 0:
            raise ArchiveTooLargeError(f"job {key[0]} has spent its snapshot budget")
        self._count[key[0]] += 1
        try:
            tar = await sandbox.download_at_most(workspace, room)
        except BaseException:
            self._count[key[0]] -= 1
            raise
        self._bytes[key[0]] += len(tar)
        return tar

    async def prepare(
        self, key: tuple[str, str], sandbox: Sandbox, workspace: str, setup: Callable[[], Awaitable[None]]
    ) -> Outcome:
        """Bring `sandbox` to the state after setup: by running it (and snapshotting), or from the snapshot."""
        fut = self._snapshots.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._snapshots[key] = fut
            try:
                await setup()
                try:
                    fut.set_result(await self._snapshot(key, sandbox, workspace))
                except ArchiveTooLargeError as e:
                    # this sample is set up; the others run their own setup (the failed future stays: no retry)
                    log.info("no snapshot of %s: %s", key[1], e)
                    fut.set_exception(RuntimeError(f"snapshot of {key[1]} skipped: {e}"))
                    fut.exception()
                    return "fallback"
            except BaseException as e:
                # the others fall back to their own setup; this rollout reports its own error
                self._snapshots.pop(key, None)
                fut.set_exception(RuntimeError(f"snapshot of {key[1]} failed: {e}"))
                fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
                raise
            return "built"
        try:
            tar = await asyncio.shield(fut)
        except RuntimeError as e:
            log.info("%s; running the setup instead", e)
            await setup()
            return "fallback"
        await sandbox.upload(tar, os.path.dirname(workspace.rstrip("/")) or "/")
        return "restored"

    def forget_job(self, job_id: str) -> None:
        """Drop the job's snapshots (its groups are done)."""
        for key in [k for k in self._snapshots if k[0] == job_id]:
            del self._snapshots[key]
        self._count.pop(job_id, None)
        self._bytes.pop(job_id, None)
