"""Prepared snapshots for groups: when a task's setup is expensive, the first sample of a group runs it and
snapshots the workspace (a tar through envd, the equivalent of `docker commit` for a tmpfs workspace); the other
samples of the group restore the snapshot instead of repeating the setup. Snapshots are dropped when the job ends.

What a snapshot holds is the workspace: a setup that must also leave state elsewhere does not declare itself
snapshot-able.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Literal

from orchestrator.core.sandbox import Sandbox

log = logging.getLogger(__name__)

Outcome = Literal["built", "restored", "fallback"]


class SnapshotCache:
    """Workspace snapshots keyed by (job id, task id), built once per group."""

    def __init__(self) -> None:
        self._snapshots: dict[tuple[str, str], asyncio.Future[bytes]] = {}

    def __len__(self) -> int:
        return len(self._snapshots)

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
                fut.set_result(await sandbox.download(workspace))
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
