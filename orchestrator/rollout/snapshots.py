"""Prepared snapshots for groups: when a task's setup is expensive, the first sample of a group runs it and
snapshots the workspace (a tar through envd, the equivalent of `docker commit` for a tmpfs workspace); the other
samples of the group restore the snapshot instead of repeating the setup. Snapshots are dropped when the job ends.

What a snapshot holds is the workspace: a setup that must also leave state elsewhere does not declare itself
snapshot-able.

Snapshots are held in the orchestrator's memory, so they are bounded: one snapshot is read no further than
`max_bytes` (counted as it streams out of envd), a job holds at most `per_job_count` snapshots and
`per_job_bytes` in all, and the process at most `total_bytes` (a tenant's many jobs cannot add up past it; a snapshot
is read within what is left, and one whose room others took meanwhile is not kept). A group whose snapshot would pass
a bound is not snapshotted: its samples each run the setup, as without snapshots (slower, never wrong).

A snapshot is restored into the workspace itself, never into its parent, so envd's check that no member and no
link lands outside the destination keeps its meaning (at "/" everything is inside). envd's Download names the
members `workspace/...`; they are taken off that prefix once, when the snapshot is made. A snapshot that envd
would refuse (a link out of the workspace, such as a venv's `bin/python -> /usr/bin/python3`, or a fifo) is not
kept: the group's samples run the setup. One that a sandbox still refuses is dropped for the rest of the group.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import io
import logging
import posixpath
import tarfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from orchestrator.core.errors import ArchiveTooLargeError, InvalidRequestError, SandboxError, SandboxFileError
from orchestrator.core.sandbox import Sandbox, escapes

log = logging.getLogger(__name__)

Outcome = Literal["built", "restored", "fallback"]


@dataclass(frozen=True)
class SnapshotBudget:
    """How much snapshot data the orchestrator holds: per snapshot, per job in count and bytes, and in all."""

    max_bytes: int = 256 << 20
    per_job_count: int = 256
    per_job_bytes: int = 1 << 30
    total_bytes: int = 4 << 30

    def shared_by(self, processes: int) -> SnapshotBudget:
        """Each of `processes` on one host's share of its bytes (a job's and all): each worker process held the
        whole, 4 GiB of memory a worker, 64 GiB on a host of 16."""
        n = max(1, processes)
        return dataclasses.replace(
            self,
            per_job_bytes=max(self.per_job_bytes // n, self.max_bytes),
            total_bytes=max(self.total_bytes // n, self.max_bytes),
        )


class _Unusable(Exception):
    """A snapshot that cannot be restored into another sandbox."""


def _rebase(tar: bytes, workspace: str, most: int) -> bytes:
    """The workspace's archive from envd's Download, its members taken off their `workspace/` prefix so that it is
    restored into the workspace itself. Raises _Unusable for a member no envd restores there: a link out of the
    workspace (an absolute one too: older envds and the fake backend refuse every absolute link), a device or a
    fifo; and for files of more than `most` bytes in all, or a sparse one (its holes come out as zeros: a few KB
    that claim a terabyte)."""
    top = posixpath.basename(posixpath.normpath(workspace))
    out = io.BytesIO()
    files = 0
    try:
        with (
            tarfile.open(fileobj=io.BytesIO(tar), mode="r|") as src,
            tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst,
        ):
            for m in src:
                rel = _relative(m.name, top)
                if rel is None:
                    continue  # the workspace itself
                info = tarfile.TarInfo(rel)
                info.type, info.mode, info.mtime = m.type, m.mode, int(m.mtime)
                if m.issym():
                    if posixpath.isabs(m.linkname) or escapes(posixpath.join(posixpath.dirname(rel), m.linkname)):
                        raise _Unusable(f"{rel} is a link out of the workspace ({m.linkname})")
                    info.linkname = m.linkname
                    dst.addfile(info)
                elif m.islnk():
                    source = _relative(m.linkname, top)
                    if source is None:
                        raise _Unusable(f"{rel} is a hard link to the workspace itself")
                    info.linkname = source
                    dst.addfile(info)
                elif m.isdir():
                    dst.addfile(info)
                elif m.issparse():
                    raise _Unusable(f"{rel} is a sparse file")
                elif m.isfile():
                    files += m.size
                    if files > most:
                        raise _Unusable(f"its files come to over {most} bytes")
                    info.type, info.size = tarfile.REGTYPE, m.size
                    dst.addfile(info, src.extractfile(m))
                else:
                    raise _Unusable(f"{rel}: devices and fifos are not restored")
    except tarfile.TarError as e:
        raise _Unusable(f"the workspace's archive could not be read: {e}") from None
    return out.getvalue()


def _relative(name: str, top: str) -> str | None:
    """A member's name inside the workspace (None: the workspace itself), or _Unusable if it lies outside."""
    norm = posixpath.normpath(name)
    if norm == top:
        return None
    if not norm.startswith(top + "/") or escapes(norm[len(top) + 1 :]):
        raise _Unusable(f"member {name!r} is not in the workspace's archive")
    return norm[len(top) + 1 :]


class SnapshotCache:
    """Workspace snapshots keyed by (job id, task id), built once per group, within a SnapshotBudget."""

    def __init__(self, budget: SnapshotBudget | None = None) -> None:
        self.budget = budget or SnapshotBudget()
        self._snapshots: dict[tuple[str, str], asyncio.Future[bytes]] = {}
        self._count: collections.Counter[str] = collections.Counter()  # per job: snapshots held or being built
        self._bytes: collections.Counter[str] = collections.Counter()  # per job: bytes held
        # per group: the samples that restored it so far (a retry of one counts once)
        self._restored: dict[tuple[str, str], set[int]] = {}

    def __len__(self) -> int:
        return len(self._snapshots)

    def held_bytes(self, job_id: str) -> int:
        """Bytes of the job's snapshots held now."""
        return self._bytes[job_id]

    def total_bytes(self) -> int:
        """Bytes held now, over every job."""
        return sum(self._bytes.values())

    def _room(self, job_id: str) -> int:
        """The most the next snapshot of the job may be (0: the job's budget, or the process's, is spent)."""
        b = self.budget
        if self._count[job_id] >= b.per_job_count:
            return 0
        return max(0, min(b.max_bytes, b.per_job_bytes - self._bytes[job_id], b.total_bytes - self.total_bytes()))

    async def _snapshot(self, key: tuple[str, str], sandbox: Sandbox, workspace: str) -> bytes:
        if key not in self._snapshots:
            raise ArchiveTooLargeError(f"job {key[0]} was forgotten while its setup ran")
        room = self._room(key[0])
        if room <= 0:
            raise ArchiveTooLargeError(f"job {key[0]} has spent its snapshot budget, or the process its own")
        self._count[key[0]] += 1
        try:
            tar = await asyncio.to_thread(_rebase, await sandbox.download_at_most(workspace, room), workspace, room)
            # others were kept while it was read: the job's and the process's budgets are checked again (the job's
            # room was read before, so a job's snapshots read side by side each took all of it)
            if self.total_bytes() + len(tar) > self.budget.total_bytes:
                raise ArchiveTooLargeError("the process's snapshot budget was spent while it was read")
            if self._bytes[key[0]] + len(tar) > self.budget.per_job_bytes:
                raise ArchiveTooLargeError(f"job {key[0]}'s snapshot budget was spent while it was read")
        except BaseException:
            if key in self._snapshots:  # else forget_job dropped the job's counts already
                self._count[key[0]] -= 1
            raise
        if key in self._snapshots:  # a job forgotten while its snapshot was read holds nothing
            self._bytes[key[0]] += len(tar)
        return tar

    async def prepare(
        self,
        key: tuple[str, str],
        sandbox: Sandbox,
        workspace: str,
        setup: Callable[[], Awaitable[None]],
        *,
        restores: int | None = None,
        sample: int = 0,
    ) -> Outcome:
        """Bring `sandbox` to the state after setup: by running it (and snapshotting), or from the snapshot. Once
        `restores` samples have restored it (the group's others, each `sample` counted once: a retry is the same
        sample), the snapshot is let go: held until the job's end, a job of more than `per_job_count` groups had
        snapshots for its first groups only, and held their bytes all along. A sample that comes after (a retry)
        runs the setup."""
        fut = self._snapshots.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._snapshots[key] = fut
            self._restored[key] = {sample}  # its builder has it: a retry of the builder that restores is no other
            try:
                await setup()
                try:
                    fut.set_result(await self._snapshot(key, sandbox, workspace))
                except (ArchiveTooLargeError, _Unusable) as e:
                    # this sample is set up; the others run their own setup (the failed future stays: no retry)
                    log.info("no snapshot of %s: %s", key[1], e)
                    self._restored.pop(key, None)
                    fut.set_exception(RuntimeError(f"snapshot of {key[1]} skipped: {e}"))
                    fut.exception()
                    return "fallback"
            except BaseException as e:
                # the others fall back to their own setup; this rollout reports its own error
                self._snapshots.pop(key, None)
                self._restored.pop(key, None)
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
        try:
            await sandbox.upload(tar, workspace)
        except (InvalidRequestError, SandboxFileError) as e:
            # refused by this sandbox's envd, so likely by every one: the group's other samples (and this one's
            # retry, on a fresh sandbox: this workspace holds part of the snapshot) run the setup instead
            self._drop(key, fut, len(tar), f"snapshot of {key[1]} could not be restored: {e}")
            raise SandboxError(f"the snapshot of {key[1]} could not be restored: {e}") from e
        restored = self._restored.setdefault(key, set())
        restored.add(sample)
        if restores is not None and len(restored) > restores:  # every sample of the group has it, its builder too
            self._drop(key, fut, len(tar), f"the snapshot of {key[1]} was restored for its group's samples", quiet=True)
        return "restored"

    def _drop(self, key: tuple[str, str], fut: asyncio.Future[bytes], size: int, why: str, quiet: bool = False) -> None:
        """Replace a snapshot by a failure, so that whoever asks for it next runs the setup."""
        if self._snapshots.get(key) is not fut:
            return  # dropped already (or the job forgotten)
        self._restored.pop(key, None)
        if not quiet:
            log.warning("%s; the group's samples run the setup", why)
        failed = asyncio.get_running_loop().create_future()
        failed.set_exception(RuntimeError(why))
        failed.exception()
        self._snapshots[key] = failed
        self._count[key[0]] -= 1
        self._bytes[key[0]] -= size

    def forget_job(self, job_id: str) -> None:
        """Drop the job's snapshots (its groups are done)."""
        for key in [k for k in self._snapshots if k[0] == job_id]:
            del self._snapshots[key]
            self._restored.pop(key, None)
        self._count.pop(job_id, None)
        self._bytes.pop(job_id, None)
