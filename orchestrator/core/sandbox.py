"""The sandbox seam: SandboxSpec in, Sandbox out, and the transport a Sandbox uses to reach inside."""

from __future__ import annotations

import abc
import logging
import math
import posixpath
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.core.errors import ArchiveTooLargeError, QuotaExceededError, SandboxUnavailableError

log = logging.getLogger(__name__)

RUNTIME_PATTERN = r"^([a-z][a-z0-9._-]{0,63})?$"
DEFAULT_LEASE_S = 3600.0  # a sandbox's lease unless its spec says otherwise


class Limits(BaseModel):
    """Resource limits of one sandbox. Each is applied or the create fails; none is silently dropped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int = Field(1024, ge=16, le=1 << 20, description="memory limit (no swap beyond it)")
    # at least the engine's smallest quota: under it NanoCpus rounds to 0, which the engine takes as no limit
    cpus: float = Field(1.0, ge=0.01, le=1024, description="CPU quota in cores (at least 0.01)")
    pids: int = Field(256, ge=8, le=1 << 22, description="maximum number of processes and threads")
    tmp_mb: int = Field(256, ge=1, le=1 << 20, description="size cap of the /tmp tmpfs")
    workspace_mb: int = Field(1024, ge=1, le=1 << 20, description="size cap of the writable workspace")


AUTO_USER = "auto"
# the uids "auto" picks from: past any host account's, and under 2^21, which a ustar archive's 7 octal digits hold (a
# repository's own tests that write tar files with the default format would fail past it)
SANDBOX_UIDS = range(100_000, 1 << 21)


class Hardening(BaseModel):
    """Hardening flags, all on by default. Turning one off is explicit and visible in the spec."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    read_only_root: bool = True
    cap_drop_all: bool = True
    no_new_privileges: bool = True
    # a PID 1 that reaps orphans: envd itself on the envd transport (always: it takes no signal from the sandbox
    # there), docker's init on docker-exec
    init: bool = True
    # "auto": each sandbox a uid of its own from SANDBOX_UIDS (its gid the same), which no host account has (nor the
    # base image), so a file it leaves on the host belongs to nobody there. The kernel counts some limits per uid
    # across every container of the host (inotify instances and watches, processes against RLIMIT_NPROC, queued
    # signals, pipe buffers): with one uid for all, one sandbox that used them up failed the others' tests.
    # "uid:gid": that user, shared by every sandbox of the spec
    user: str = Field(
        AUTO_USER,
        pattern=rf"^({AUTO_USER}|[0-9]+:[0-9]+)$",
        description="'auto' (a uid of its own per sandbox) or uid:gid; never root",
    )

    @field_validator("user")
    @classmethod
    def _not_root(cls, v: str) -> str:
        if v == AUTO_USER:
            return v
        uid = int(v.split(":")[0])  # as the engine reads it: "00" is uid 0 too
        if uid == 0:
            raise ValueError("the sandbox user must not be root (uid 0)")
        if uid in SANDBOX_UIDS:
            # such a user would share its uid, and the kernel's per-uid counts, with an "auto" sandbox
            raise ValueError(
                f"uids {SANDBOX_UIDS.start} to {SANDBOX_UIDS.stop - 1} are those 'auto' gives each sandbox: choose "
                f"'auto', or a uid outside them"
            )
        return v


class SandboxSpec(BaseModel):
    """What to create: an image, limits, hardening, and how to reach inside."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = Field(min_length=1)
    limits: Limits = Limits()
    hardening: Hardening = Hardening()
    workspace: str = Field("/workspace", pattern=r"^/[^\x00]*$")
    env: dict[str, str] = Field(default_factory=dict, description="environment of envd's processes")
    labels: dict[str, str] = Field(default_factory=dict)
    ttl_s: float = Field(DEFAULT_LEASE_S, gt=0, le=7 * 24 * 3600, description="lease: the sweep removes it after this")
    startup_timeout_s: float = Field(30.0, gt=0, le=600)
    transport: Literal["envd", "docker-exec"] = "envd"
    # chosen by a tenant on the wire: the service layer checks it against `caps.sandbox.runtimes`, the backend
    # fails the create when its engine lacks it
    runtime: str = Field(
        "",
        pattern=RUNTIME_PATTERN,
        description="OCI runtime of the container (runc, runsc for gVisor); empty: the backend's default",
    )


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one command."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    signal: int = 0
    timed_out: bool = False
    truncated: bool = False
    oom_killed: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Exited 0 on its own."""
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class ExecStarted:
    """The command's process exists."""

    pid: int


@dataclass(frozen=True)
class ExecOutput:
    """A chunk of output, in arrival order."""

    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True)
class ExecEnded:
    """The command and everything it started are gone."""

    exit_code: int
    signal: int
    timed_out: bool
    truncated: bool
    oom_killed: bool
    duration_s: float


ExecEvent = ExecStarted | ExecOutput | ExecEnded


@dataclass(frozen=True)
class FileEntry:
    """One directory entry (links are reported, never followed)."""

    name: str
    path: str
    kind: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    link_target: str = ""


@dataclass(frozen=True)
class ResetOutcome:
    """Whether an in-place reset left the sandbox pristine; if not, it must be destroyed."""

    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class SandboxState:
    """The container's state as the engine sees it."""

    running: bool
    exit_code: int | None
    oom_killed: bool
    error: str = ""


Command = str | Sequence[str]
# A command's stdin: bytes, or chunks that are streamed into it as it reads them (never gathered in memory by envd's
# transport; other transports gather them up to a cap, see read_stdin)
Stdin = bytes | AsyncIterable[bytes]


async def read_stdin(stdin: Stdin, max_bytes: int, why: str) -> bytes:
    """Streamed stdin gathered whole, for a path that cannot stream it; QuotaExceededError past `max_bytes`."""
    if isinstance(stdin, bytes):
        data = stdin
    else:
        parts: list[bytes] = []
        total = 0
        async for chunk in stdin:
            total += len(chunk)
            if total > max_bytes:
                raise QuotaExceededError(f"stdin is over {max_bytes} bytes, the most {why} takes")
            parts.append(chunk)
        data = b"".join(parts)
    if len(data) > max_bytes:
        raise QuotaExceededError(f"stdin is {len(data)} bytes, over {max_bytes}, the most {why} takes")
    return data


def _at_most(data: bytes, max_bytes: int, path: str) -> bytes:
    if len(data) > max_bytes:
        raise ArchiveTooLargeError(f"the archive of {path!r} is {len(data)} bytes, over the cap of {max_bytes}")
    return data


Liveness = Literal["alive", "slow", "gone"]


def escapes(path: str) -> bool:
    """Whether a tar member's name (or a link's target, joined to its member's folder) leaves the folder it is
    unpacked into: absolute, or up past it once normalized. envd judges uploads by the same rule."""
    norm = posixpath.normpath(path)
    return posixpath.isabs(norm) or norm == ".." or norm.startswith("../")


class Transport(abc.ABC):
    """How a Sandbox reaches inside its container: envd over a unix socket, or `docker exec`."""

    @abc.abstractmethod
    def exec_stream(
        self,
        cmd: Command,
        *,
        cwd: str | None,
        env: Mapping[str, str] | None,
        stdin: Stdin,
        timeout: float | None,
        max_output: int | None,
    ) -> AsyncIterator[ExecEvent]:
        """Run a command (a string runs under /bin/sh -c), streaming its events."""

    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin = b"",
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> ExecResult:
        """Run a command and collect its output."""
        out: list[bytes] = []
        err: list[bytes] = []
        end: ExecEnded | None = None
        async for ev in self.exec_stream(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output):
            if isinstance(ev, ExecOutput):
                (out if ev.stream == "stdout" else err).append(ev.data)
            elif isinstance(ev, ExecEnded):
                end = ev
        if end is None:  # envd's stream ends with the process's end; one that does not is no envd of ours
            raise SandboxUnavailableError("the sandbox's exec stream ended without the process's exit status")
        return ExecResult(
            exit_code=end.exit_code,
            stdout=b"".join(out),
            stderr=b"".join(err),
            signal=end.signal,
            timed_out=end.timed_out,
            truncated=end.truncated,
            oom_killed=end.oom_killed,
            duration_s=end.duration_s,
        )

    @abc.abstractmethod
    async def read_file(self, path: str, max_bytes: int = 0) -> bytes:
        """The content of a regular file."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True) -> None:
        """Create or replace a file."""

    @abc.abstractmethod
    async def list_dir(self, path: str) -> list[FileEntry]:
        """A directory's entries."""

    @abc.abstractmethod
    async def upload(self, tar: bytes, dest_dir: str) -> int:
        """Extract a tar archive into dest_dir; returns the number of entries written."""

    @abc.abstractmethod
    async def download(self, path: str) -> bytes:
        """A tar archive of a file or directory (links stored as links)."""

    async def download_at_most(self, path: str, max_bytes: int) -> bytes:
        """Like download, but ArchiveTooLargeError once the archive passes `max_bytes`. This default reads it whole
        first; a transport that streams overrides it to stop reading at the cap."""
        return _at_most(await self.download(path), max_bytes, path)

    @abc.abstractmethod
    async def health(self, timeout: float) -> bool:
        """Whether the inside answers."""

    async def probe(self, timeout: float) -> Liveness:
        """Whether a sandbox thought alive still is: "alive" (it answered), "gone" (refused, or answered that it is
        not serving) or "slow" (no answer within `timeout`: there, but starved of CPU). This transport cannot tell
        slow from gone: no answer in time counts as gone."""
        return "alive" if await self.health(timeout) else "gone"

    async def reset(self, workspace_seed: str) -> ResetOutcome:
        """Return the sandbox to a pristine state in place; a transport that cannot says so (ok=False)."""
        return ResetOutcome(False, f"{type(self).__name__} cannot reset a sandbox in place")

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""


class Sandbox(abc.ABC):
    """One isolated machine for one rollout."""

    id: str
    name: str
    spec: SandboxSpec

    @abc.abstractmethod
    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin = b"",
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> ExecResult:
        """Run a command (a string runs under /bin/sh -c) and collect its output."""

    @abc.abstractmethod
    def exec_stream(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin = b"",
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> AsyncIterator[ExecEvent]:
        """Run a command, streaming started, output chunks and ended."""

    @abc.abstractmethod
    async def read_file(self, path: str, max_bytes: int = 0) -> bytes:
        """The content of a regular file."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True) -> None:
        """Create or replace a file."""

    @abc.abstractmethod
    async def list_dir(self, path: str) -> list[FileEntry]:
        """A directory's entries."""

    @abc.abstractmethod
    async def upload(self, tar: bytes, dest_dir: str) -> int:
        """Extract a tar archive into dest_dir."""

    @abc.abstractmethod
    async def download(self, path: str) -> bytes:
        """A tar archive of a file or directory."""

    async def download_at_most(self, path: str, max_bytes: int) -> bytes:
        """Like download, but ArchiveTooLargeError once the archive passes `max_bytes`, read no further than that
        through a transport that streams (envd); other sandboxes (the fake's, in memory) read it whole first."""
        transport = getattr(self, "transport", None)
        if isinstance(transport, Transport):
            self.thaw()
            return await transport.download_at_most(path, max_bytes)
        return _at_most(await self.download(path), max_bytes, path)

    @abc.abstractmethod
    async def state(self) -> SandboxState:
        """The container's state (running, exit code, OOM-killed)."""

    async def probe(self, timeout: float) -> Liveness:
        """Whether this sandbox, thought alive, still is: its transport's probe ("alive" for a sandbox with no
        transport to ask; "gone" when asking failed, e.g. its channel closed under it). No engine call."""
        transport = getattr(self, "transport", None)
        if not isinstance(transport, Transport):
            return "alive"
        try:
            return await transport.probe(timeout)
        except Exception as e:
            log.info("probe of %s failed: %s", getattr(self, "name", "?"), e)
            return "gone"

    @abc.abstractmethod
    async def close(self) -> None:
        """Destroy the sandbox and wait until it is gone. Idempotent."""

    async def reset(self, workspace_seed: str = "") -> ResetOutcome:
        """Kill every process, wipe every writable place and restore the workspace, for reuse by another rollout."""
        return ResetOutcome(False, f"{type(self).__name__} cannot be reset in place")

    async def release(self) -> None:
        """Give the sandbox up: it is unusable at once and destroyed in the background (the backend's close()
        waits for that). The rollout path uses this, so a finished rollout does not wait on the engine."""
        await self.close()

    def freeze(self) -> bool:
        """Stop every process of this idle sandbox, so that it costs no CPU until it is used again (any call thaws
        it first); False where the backend cannot, and nothing changed."""
        return False

    def thaw(self) -> None:  # noqa: B027 - a backend that cannot freeze has nothing to thaw
        """Let a frozen sandbox's processes run again; nothing if it is not frozen."""

    def lease_left_s(self) -> float:
        """Seconds until its lease ends and the backend's sweep may remove it, in use or not; inf: no lease."""
        return math.inf

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


PROBE_TIMEOUT_S = 10.0  # keeps_time's do-nothing shell: its limit...
PROBE_SLOW_S = 2.0  # ...and what it may take in a sandbox that keeps time


async def keeps_time(sandbox: Sandbox, what: str, cwd: str = "/") -> None:
    """SandboxUnavailableError (INFRA_ERROR, retried) unless a shell that does nothing runs in the sandbox in time:
    `what` (a grader's run past its timeout) on a host too busy to run anything is the fleet's doing, never a 0."""
    t0 = time.monotonic()
    r = await sandbox.exec(["/bin/sh", "-c", ":"], cwd=cwd, timeout=PROBE_TIMEOUT_S)
    took = time.monotonic() - t0
    # a shell that failed in time (the policy, as root, broke /bin/sh) says the host keeps time: it was an
    # INFRA_ERROR, retried and masked, which a policy about to score 0 could choose
    if r.timed_out or took > PROBE_SLOW_S:
        raise SandboxUnavailableError(
            f"{what}, and a shell that does nothing took {took:.1f}s in the sandbox (exit code {r.exit_code}): the "
            "host, not the policy, is slow"
        )


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as listed by its backend."""

    id: str
    name: str
    image: str
    status: str
    labels: Mapping[str, str]


class SandboxBackend(abc.ABC):
    """Creates sandboxes and cleans up after owners that died."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """A ready sandbox: its first exec can run as soon as this returns."""

    @abc.abstractmethod
    async def list_owned(self) -> list[SandboxInfo]:
        """The sandboxes this backend instance created and has not destroyed."""

    @abc.abstractmethod
    async def sweep(self, older_than: float | None = None) -> int:
        """Remove sandboxes of dead owners and expired leases; returns how many were removed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Destroy every owned sandbox and stop background work."""

    # how long, in all, a rollout waits for this backend's engine to answer again (wait_answering); 0: not at all
    outage_wait_s: float = 0.0

    async def wait_answering(self, limit_s: float) -> float:
        """Wait for a backend found not answering (its container engine restarting) to answer again, `limit_s` at
        most; the seconds waited, 0 at once while it answers. A backend that never stops answering returns 0."""
        return 0.0

    def engine_answering(self) -> bool:
        """Whether the engine answered last (False while a rollout that needs it would wait, wait_answering)."""
        return True


# The same task and sample always see the same environment variables and seed.
DETERMINISTIC_ENV = {"PYTHONHASHSEED": "0", "TZ": "UTC", "LC_ALL": "C.UTF-8"}
