"""Raw sandboxes (E2B style): a tenant creates a hardened sandbox, runs commands and moves files, then deletes it.

Hardening and limits are the backend's, validated by SandboxSpec exactly as for rollouts; only envfleet images (they
carry envd) or an environment's image may be used. A sandbox whose TTL ends is destroyed; its owner then sees it
as EXPIRED in List and a NOT_FOUND that says so from every other call. Another tenant's sandbox is reported exactly
like a missing one, and another tenant's private environment exactly like a missing environment.

Caps (`caps:` in the server configuration, RESOURCE_EXHAUSTED naming the cap): a sandbox's limits, live sandboxes
per tenant, open Execs per tenant, Exec stdin per request and in flight per tenant, and the size of a file read or an
archive downloaded, which is counted while it streams out of envd and refused at the cap, never read whole first. A
raw sandbox counts against the host's capacity (the scheduler's admission) until it ends.

A sandbox whose container died (killed from outside, the OOM killer, envd gone, a dockerd restart) ends as soon as
a call finds it dead, or at its next health check (every `probe_interval_s`: a health call to its envd, and an
engine call only when envd refuses): its capacity and the tenant's slot come back, the backend removes its container
and socket folder, and every call on it is a NOT_FOUND saying it died, when, and how. List shows it DIED, with the
cause in `end_reason`.

Exec stdin is one field of one message on the trainer API and again on envd's Start, so the server holds a few
copies of it while the call is handed on (measured: about 3.5x the stdin bytes); capping what a tenant may have in
flight bounds that to a known figure. Larger inputs belong in Upload or WriteFile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.backends.pool import TENANT_LABEL
from orchestrator.core.echo import echo
from orchestrator.core.environment import ImageSource
from orchestrator.core.errors import (
    ArchiveTooLargeError,
    BusyError,
    InvalidRequestError,
    NotFoundError,
    QuotaExceededError,
    SandboxDiedError,
    SandboxError,
)
from orchestrator.core.sandbox import (
    Command,
    ExecEvent,
    Limits,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
)
from orchestrator.images.build import IMAGE_REFERENCE
from orchestrator.service.caps import CapsConfig, TenantBytes, TenantCounter, check_limits
from orchestrator.service.declarative.dockerfile import TENANT_IMAGE_PREFIX
from orchestrator.service.registry import Registry
from orchestrator.service.sandbox_health import death, died, each_checked
from orchestrator.service.scheduler import Need, Reservation, Scheduler

log = logging.getLogger(__name__)
T = TypeVar("T")
# given the release of a reply's budget, calls it once the reply is sent (the RPC's end)
UntilSent = Callable[[Callable[[], None]], None]

State = Literal["RUNNING", "EXPIRED", "DELETED", "DIED"]
ENVFLEET_IMAGE_PREFIX = "envfleet/"
TOMBSTONE_KEEP_S = 3600.0
MAX_TOMBSTONES_PER_TENANT = 1000
LEASE_GRACE_S = 60.0
MAX_LEASE_S = 7 * 24 * 3600.0  # SandboxSpec's limit
DESTROY_CONCURRENCY = 16  # expired sandboxes removed at once
_STDIN_BOUND_SLACK = 16  # a stdin length bound from message sizes is at most this much over the length
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ENV_STRING_BYTES = 128 << 10  # MAX_ARG_STRLEN: one environment string, its NUL counted
# the sandbox's variables, and an exec's: both go to the same execve, beside the image's own and the command's argv,
# so each has this much, and the two together stay within the usual ARG_MAX of 2 MiB with room to spare
ENV_TOTAL_BYTES = 768 << 10


class SandboxServiceConfig(BaseModel):
    """Limits of the raw sandbox API."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_ttl_s: float = Field(3600.0, gt=0, le=7 * 24 * 3600)
    max_ttl_s: float = Field(24 * 3600.0, gt=0, le=7 * 24 * 3600)
    max_per_tenant: int = Field(32, ge=1, le=100_000, description="live sandboxes per tenant")
    reap_interval_s: float = Field(1.0, gt=0, le=3600)
    probe_interval_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="how often each running sandbox's envd gets a health check; one that refuses, and whose container"
        " the engine reports stopped, is ended (a dead container otherwise holds its capacity and the tenant's slot"
        " until its ttl, when no call finds it dead first)",
    )
    exec_default_timeout_s: float = Field(60.0, gt=0)
    exec_max_timeout_s: float = Field(3600.0, gt=0)
    default_max_output: int = Field(1 << 20, ge=1)
    max_output: int = Field(32 << 20, ge=1, le=48 << 20, description="per exec, and per file read or download")


@dataclass(frozen=True)
class SandboxRecord:
    """A tenant's view of one of its sandboxes."""

    sandbox_id: str
    image: str
    env: str
    state: State
    limits: Limits
    created_at: float
    expires_at: float
    ended_at: float = 0.0
    end_reason: str = ""
    runtime: str = ""


@dataclass
class _Live:
    record: SandboxRecord
    tenant: str
    sandbox: Sandbox
    reservation: Reservation | None = None
    probe_at: float = 0.0  # time.monotonic() of its next health check
    # time.monotonic() of its ttl's end (record.expires_at is the wall clock's, to show): on the wall clock, a clock
    # set an hour on destroyed tenants' sandboxes an hour early, and one set back kept them (and their quota) on
    ends_at: float = math.inf


def _limits(base: Limits, overrides: Mapping[str, Any]) -> Limits:
    try:
        return Limits.model_validate({**base.model_dump(), **overrides})
    except ValidationError as e:
        bad = "; ".join(
            f"limits.{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})" for err in e.errors()
        )
        raise InvalidRequestError(bad) from None


MAX_ENV_VARS = 256  # variables of one sandbox or one exec


def _check_env_vars(env: Mapping[str, str], what: str) -> dict[str, str]:
    """The variables, as the kernel takes them: each NAME=value string within MAX_ARG_STRLEN and all of them well
    within ARG_MAX, counted in UTF-8 bytes (a cap in characters let values through that execve refused with E2BIG:
    the sandbox failed to start, UNAVAILABLE, which a client retries)."""
    if len(env) > MAX_ENV_VARS:
        raise InvalidRequestError(f"{what}: at most {MAX_ENV_VARS} variables")
    total = 0
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):  # `$` alone let a trailing newline through
            raise InvalidRequestError(f"{what}: {echo(name)} is not a variable name")
        try:
            size = len(name) + 1 + len(value.encode()) + 1  # NAME=value and its NUL
        except UnicodeEncodeError:
            raise InvalidRequestError(f"{what}: the value of {name} is not text (a lone surrogate)") from None
        if "\0" in value or size > ENV_STRING_BYTES:
            raise InvalidRequestError(
                f"{what}: {name}=value holds NUL or is over {ENV_STRING_BYTES} bytes (the kernel's limit per string)"
            )
        total += size
    if total > ENV_TOTAL_BYTES:
        raise InvalidRequestError(f"{what}: the variables come to {total} bytes, over {ENV_TOTAL_BYTES}")
    return dict(env)


class _Deferred:
    """Stdin still in its request message: copied out only once the caps have let it through."""

    def __init__(self, read: Callable[[], bytes]) -> None:
        self.get = read


class SandboxManager:
    """Every tenant's raw sandboxes. Start with `SandboxManager.start(...)`; `close()` destroys them all."""

    def __init__(
        self,
        config: SandboxServiceConfig,
        registry: Registry,
        backend: SandboxBackend,
        images: ImageSource,
        image_present: Callable[[str], bool],
        *,
        caps: CapsConfig | None = None,
        admission: Scheduler | None = None,
    ) -> None:
        self.config = config
        self._registry = registry
        self._backend = backend
        self._images = images
        self._image_present = image_present  # blocking (run in a thread); False for an invalid reference too
        self.caps = caps or CapsConfig()
        self._admission = admission  # None: raw sandboxes are not counted against the host's capacity
        self._execs = TenantCounter(self.caps.streams_per_tenant, "caps.streams_per_tenant", "Execs")
        self._stdin = TenantCounter(self.caps.stdin_bytes_per_tenant, "caps.stdin_bytes_per_tenant", "stdin bytes")
        self._writes = TenantCounter(self.caps.write_bytes_per_tenant, "caps.write_bytes_per_tenant", "bytes of writes")
        self._replies = TenantBytes(self.caps.read_bytes_per_tenant, "caps.read_bytes_per_tenant", "bytes of replies")
        self._live: dict[str, _Live] = {}
        self._reserved: dict[str, int] = {}
        self._ended: dict[str, OrderedDict[str, SandboxRecord]] = {}  # tenant -> its tombstones, oldest first
        self._reaper: asyncio.Task[None] | None = None
        self._destroying: set[asyncio.Future[None]] = set()  # removals a List left behind it

    @classmethod
    def start(
        cls,
        config: SandboxServiceConfig,
        registry: Registry,
        backend: SandboxBackend,
        images: ImageSource,
        image_present: Callable[[str], bool],
        *,
        caps: CapsConfig | None = None,
        admission: Scheduler | None = None,
    ) -> SandboxManager:
        """A manager that destroys sandboxes whose TTL ended, in the background."""
        mgr = cls(config, registry, backend, images, image_present, caps=caps, admission=admission)
        mgr._reaper = asyncio.create_task(mgr._reap_forever(), name="sandbox reaper")
        return mgr

    async def _image_and_limits(
        self, tenant: str, image: str, env_ref: str, overrides: Mapping[str, Any]
    ) -> tuple[str, Limits, str]:
        """The image tag, limits and runtime (the environment's, if any) of a new sandbox."""
        if bool(image) == bool(env_ref):
            raise InvalidRequestError("give exactly one of image and env")
        if env_ref:
            env = self._registry.get(env_ref, tenant)
            tag, _ = await self._images.resolve(env)
            return tag, _limits(env.limits, overrides), env.runtime
        if not image.startswith(ENVFLEET_IMAGE_PREFIX) or len(image) > 256:
            raise InvalidRequestError(
                f"image {echo(image)}: only envfleet images (envfleet/...) may be used; they carry envd"
            )
        if not IMAGE_REFERENCE.match(image):
            # checked by its text alone, "envfleet/x/../env-y" passed the prefix checks, for the engine to clean
            raise InvalidRequestError(
                f"image {echo(image)} is no image reference: lowercase [a-z0-9] words joined by '.', '_', '-' or "
                "'/', then an optional :tag"
            )
        if image.startswith(TENANT_IMAGE_PREFIX):
            # by its tag, an environment's image passes no registry: it may be another tenant's private one, with
            # what its owner built into it (hidden tests, data)
            raise InvalidRequestError(
                f"image {echo(image)} is a registered environment's image: create the sandbox with env=NAME instead"
            )
        if not await asyncio.to_thread(self._image_present, image):
            raise NotFoundError(f"image {echo(image)} is not on this host; build it first (envfleet image build-base)")
        return image, _limits(Limits(), overrides), ""

    async def create(
        self,
        tenant: str,
        *,
        image: str = "",
        env: str = "",
        limits: Mapping[str, Any] | None = None,
        ttl_s: float = 0.0,
        env_vars: Mapping[str, str] | None = None,
        runtime: str = "",
    ) -> SandboxRecord:
        """A running sandbox owned by `tenant`, destroyed after `ttl_s` (0: the default), under OCI `runtime` (empty:
        the environment's, then the backend's default)."""
        ttl = ttl_s or self.config.default_ttl_s
        if not 0 < ttl <= self.config.max_ttl_s:
            raise InvalidRequestError(f"ttl_s must be between 0 and {self.config.max_ttl_s:g}, got {ttl_s!r}")
        variables = _check_env_vars(env_vars or {}, "env_vars")
        # the tenant's cap before any engine call: a tenant at its cap kept thousands of image lookups in flight, on
        # the threads every sandbox start shares. Its place is held from here, so creates side by side count
        live_now = sum(x.tenant == tenant for x in self._live.values()) + self._reserved.get(tenant, 0)
        if live_now >= self.config.max_per_tenant:
            raise BusyError(
                f"{live_now} sandboxes are running; sandboxes.max_per_tenant is {self.config.max_per_tenant}; "
                "delete some"
            )
        self._reserved[tenant] = self._reserved.get(tenant, 0) + 1
        reservation = None
        try:
            tag, lim, env_runtime = await self._image_and_limits(tenant, image, env, limits or {})
            runtime = runtime or env_runtime
            check_limits(lim, self.caps.sandbox, runtime=runtime)
            need = Need(cpus=lim.cpus, memory_mb=lim.memory_mb)
            reservation = self._admission.reserve(need, "a sandbox", tenant) if self._admission is not None else None
            sid = "sb-" + secrets.token_hex(10)
            sandbox = await self._backend.create(
                SandboxSpec(
                    image=tag,
                    limits=lim,
                    runtime=runtime,
                    env=variables,
                    labels={"envfleet.sandbox": sid, TENANT_LABEL: tenant},
                    ttl_s=min(ttl + LEASE_GRACE_S, MAX_LEASE_S),
                )
            )
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        finally:
            self._reserved[tenant] -= 1
            if not self._reserved[tenant]:
                del self._reserved[tenant]
        now, mono = time.time(), time.monotonic()
        left = min(ttl, sandbox.lease_left_s())  # never past its container's lease, which the sweep goes by
        record = SandboxRecord(sid, tag, env, "RUNNING", lim, now, now + left, runtime=runtime)
        self._live[sid] = _Live(record, tenant, sandbox, reservation, mono + self.config.probe_interval_s, mono + left)
        return record

    def _tombstone(self, tenant: str, sandbox_id: str) -> SandboxRecord | None:
        return self._ended.get(tenant, OrderedDict()).get(sandbox_id)

    async def _get(self, tenant: str, sandbox_id: str) -> _Live:
        live = self._live.get(sandbox_id)
        if live is not None and live.tenant == tenant:
            if time.monotonic() < live.ends_at:
                return live
            await self._end(live, "EXPIRED", "its ttl ended")
        tomb = self._tombstone(tenant, sandbox_id)
        if tomb is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(tomb.ended_at))
            # its state says how it ended: "expired", "deleted" or "died" at ...
            raise NotFoundError(f"sandbox {sandbox_id} {tomb.state.lower()} at {when} ({tomb.end_reason})")
        raise NotFoundError(f"no sandbox {echo(sandbox_id)}")

    async def _end(self, live: _Live, state: State, reason: str) -> None:
        """Forget a sandbox (a tombstone tells its owner how it ended, and why), give its capacity back and destroy
        it."""
        if self._forget(live, state, reason):
            await self._destroy(live)

    def _forget(self, live: _Live, state: State, reason: str) -> bool:
        """_end's bookkeeping, at once: False when the sandbox had ended already."""
        sid = live.record.sandbox_id
        if self._live.pop(sid, None) is None:
            return False
        ended = self._ended.setdefault(live.tenant, OrderedDict())
        ended[sid] = dataclasses.replace(live.record, state=state, ended_at=time.time(), end_reason=reason)
        while len(ended) > MAX_TOMBSTONES_PER_TENANT:
            ended.popitem(last=False)
        if live.reservation is not None:
            live.reservation.release()
        return True

    async def _destroy(self, live: _Live) -> None:
        try:
            await asyncio.shield(live.sandbox.close())
        except SandboxError:
            log.warning("could not destroy sandbox %s", live.record.sandbox_id, exc_info=True)

    async def _died(self, live: _Live, reason: str) -> None:
        log.warning("sandbox %s of %s died: %s; destroying it", live.record.sandbox_id, live.tenant, reason)
        await self._end(live, "DIED", reason)

    async def _use(self, live: _Live, call: Awaitable[T]) -> T:
        """Run a call on a sandbox; if it failed because the sandbox ended meanwhile or died, say so (NOT_FOUND): a
        retry cannot help, and a dead one is ended here, so its capacity and slot come back at once."""
        try:
            return await call
        except SandboxDiedError:
            if live.record.sandbox_id in self._live:
                try:
                    reason = death(await live.sandbox.state())
                except SandboxError:
                    reason = "its container stopped"  # dead on the backend's word; the engine said how, not now
                await self._died(live, reason)
            await self._get(live.tenant, live.record.sandbox_id)
            raise
        except SandboxError:
            if live.record.sandbox_id not in self._live:
                await self._get(live.tenant, live.record.sandbox_id)
            raise

    async def get(self, tenant: str, sandbox_id: str) -> SandboxRecord:
        """A sandbox of the tenant's that is running; NOT_FOUND (saying when and why) for one that ended."""
        return (await self._get(tenant, sandbox_id)).record

    async def list(self, tenant: str) -> list[SandboxRecord]:
        """The tenant's running sandboxes, then those that ended in the last hour."""
        # the expired ones ended here, their containers removed behind the answer: awaited, every tenant's List
        # waited on the removal of each sandbox any tenant let expire, one after another
        if doomed := self._expire():
            self._destroying_behind(doomed)
        running = [x.record for x in self._live.values() if x.tenant == tenant]
        ended = list(self._ended.get(tenant, OrderedDict()).values())
        return sorted(running, key=lambda r: r.created_at) + ended

    def _exec_limits(self, timeout_s: float, max_output: int) -> tuple[float, int]:
        c = self.config
        timeout = timeout_s or c.exec_default_timeout_s
        if not 0 < timeout <= c.exec_max_timeout_s:
            raise InvalidRequestError(f"timeout_s must be between 0 and {c.exec_max_timeout_s:g}, got {timeout_s!r}")
        cap = max_output or c.default_max_output
        if not 0 < cap <= c.max_output:
            raise InvalidRequestError(f"max_output_bytes must be between 0 and {c.max_output}, got {max_output}")
        return timeout, cap

    async def exec_stream(
        self,
        tenant: str,
        sandbox_id: str,
        cmd: Command,
        *,
        cwd: str = "",
        env: Mapping[str, str] | None = None,
        stdin: bytes | Callable[[], bytes] | AsyncIterable[bytes] = b"",
        stdin_size: int | None = None,
        timeout_s: float = 0.0,
        max_output: int = 0,
    ) -> AsyncIterator[ExecEvent]:
        """Run a command, streaming started, stdout/stderr chunks and ended. `stdin` may be a function that gives the
        bytes, with `stdin_size` an upper bound of their length: the wire edge passes one, so a request refused by a
        stdin cap is never copied out of its message. Chunks (an async iterable, ExecStream) are streamed into the
        process as it reads them: no per-request cap applies, since no more than a chunk or two is ever held."""
        if isinstance(cmd, str):
            if not cmd.strip() or "\0" in cmd:
                raise InvalidRequestError("shell: the command is empty or holds NUL")
        elif not cmd or any("\0" in a for a in cmd):
            raise InvalidRequestError("argv: give at least one argument, none holding NUL")
        if "\0" in cwd:
            raise InvalidRequestError("cwd holds NUL")
        timeout, cap = self._exec_limits(timeout_s, max_output)
        variables = _check_env_vars(env or {}, "env")
        data: bytes | _Deferred | AsyncIterable[bytes]
        if isinstance(stdin, AsyncIterable):
            data, size = stdin, 0
        else:
            size = self._stdin_size(stdin, stdin_size)
            if size > self.caps.exec_stdin_bytes and not isinstance(stdin, bytes):
                stdin = stdin()  # a bound within a few bytes of the cap: the exact length decides
                size = self._stdin_size(stdin, None)
            data = stdin if isinstance(stdin, bytes) else _Deferred(stdin)
        del stdin
        run = self._exec(tenant, sandbox_id, cmd, cwd, variables, data, size, timeout, cap)
        del data
        async with contextlib.aclosing(run) as events:
            async for ev in events:
                yield ev

    async def _exec(
        self,
        tenant: str,
        sandbox_id: str,
        cmd: Command,
        cwd: str,
        variables: Mapping[str, str],
        stdin: bytes | _Deferred | AsyncIterable[bytes],
        size: int,
        timeout: float,
        cap: int,
    ) -> AsyncGenerator[ExecEvent, None]:
        """Run a checked command, holding one of the tenant's Execs and `size` bytes of its stdin budget."""
        live = await self._get(tenant, sandbox_id)
        with self._execs.hold(tenant), self._stdin.hold(tenant, size):
            data = stdin.get() if isinstance(stdin, _Deferred) else stdin
            stream = live.sandbox.exec_stream(
                cmd, cwd=cwd or None, env=variables, stdin=data, timeout=timeout, max_output=cap
            )
            del data, stdin  # the sandbox's call holds what it needs
            try:
                while True:
                    try:
                        event = await self._use(live, anext(stream))
                    except StopAsyncIteration:
                        return
                    yield event
            finally:
                with contextlib.suppress(Exception):
                    await stream.aclose()  # type: ignore[attr-defined]

    def _stdin_size(self, stdin: bytes | Callable[[], bytes], bound: int | None) -> int:
        """The stdin's length (or its bound); QuotaExceededError when it is surely over the cap."""
        exact = isinstance(stdin, bytes) or bound is None
        size = len(stdin) if isinstance(stdin, bytes) else bound if bound is not None else len(stdin())
        cap = self.caps.exec_stdin_bytes
        if size > cap + (0 if exact else _STDIN_BOUND_SLACK):
            raise QuotaExceededError(
                f"stdin is {size} bytes; caps.exec_stdin_bytes is {cap} per Exec (use Upload or WriteFile for "
                "larger inputs)"
            )
        return size

    async def read_file(
        self, tenant: str, sandbox_id: str, path: str, max_bytes: int = 0, *, until_sent: UntilSent | None = None
    ) -> tuple[bytes, bool]:
        """A file's content (at most max_bytes, 0: the configured cap), and whether the file went on past it (its
        first bytes read as the whole file gave a trainer's own loop a reward the file did not hold). It counts
        against the tenant's caps.read_bytes_per_tenant while it is read, and then, given `until_sent`, until the
        caller hands back the release it is given (once the reply is sent)."""
        if not 0 <= max_bytes <= self.config.max_output:
            raise InvalidRequestError(f"max_bytes must be between 0 and {self.config.max_output}, got {max_bytes}")
        live = await self._get(tenant, sandbox_id)
        cap = max_bytes or self.config.max_output
        # one byte past the cap says whether there was more (the budget holds the cap: a budget of exactly the cap
        # still reads)
        data = await self._held_reply(
            tenant, cap, lambda: self._use(live, live.sandbox.read_file(path, cap + 1)), until_sent
        )
        return data[:cap], len(data) > cap

    async def write_file(self, tenant: str, sandbox_id: str, path: str, data: bytes, mode: int = 0) -> None:
        """Create or replace a file (parents are created)."""
        if not 0 <= mode <= 0o7777:
            raise InvalidRequestError(f"mode must be a permission mode (0 to 0o7777), got {mode}")
        live = await self._get(tenant, sandbox_id)
        with self._writes.hold(tenant, len(data)):
            await self._use(live, live.sandbox.write_file(path, data, mode or 0o644))

    async def upload(self, tenant: str, sandbox_id: str, tar: bytes, dest_dir: str) -> int:
        """Extract a tar archive into dest_dir; returns the number of entries."""
        live = await self._get(tenant, sandbox_id)
        with self._writes.hold(tenant, len(tar)):
            return await self._use(live, live.sandbox.upload(tar, dest_dir or "."))

    async def download(self, tenant: str, sandbox_id: str, path: str, *, until_sent: UntilSent | None = None) -> bytes:
        """A tar archive of a file or folder (links stored as links); refused once it streams past the cap. Counted
        as read_file's reply is."""
        live = await self._get(tenant, sandbox_id)
        cap = self.config.max_output
        try:
            return await self._held_reply(
                tenant, cap, lambda: self._use(live, live.sandbox.download_at_most(path, cap)), until_sent
            )
        except ArchiveTooLargeError:
            raise QuotaExceededError(
                f"the archive of {echo(path)} is over sandboxes.max_output = {cap} bytes; download less at a time"
            ) from None

    async def _held_reply(
        self, tenant: str, cap: int, read: Callable[[], Awaitable[bytes]], until_sent: UntilSent | None
    ) -> bytes:
        """`read()`'s bytes, with `cap` of the tenant's reply budget held while it runs (waiting for room first),
        then their size, released now or, with `until_sent`, when the release it is handed is called."""
        taken = await self._replies.take(tenant, cap)
        try:
            data = await read()
        except BaseException:
            taken.release()
            raise
        taken.shrink(len(data))
        if until_sent is None:
            taken.release()
        else:
            until_sent(taken.release)
        return data

    async def delete(self, tenant: str, sandbox_id: str) -> None:
        """Destroy a sandbox now."""
        live = await self._get(tenant, sandbox_id)
        await self._end(live, "DELETED", "deleted by its owner")

    async def reap(self) -> int:
        """Destroy sandboxes whose TTL ended, and forget old tombstones; returns how many were destroyed."""
        doomed = self._expire()
        if doomed:
            await asyncio.shield(self._destroying_behind(doomed))  # the reaper stopped midway: close_all awaits them
        return len(doomed)

    def _expire(self) -> Sequence[_Live]:
        """End (_forget) the sandboxes whose TTL ended, and forget old tombstones; returns those to destroy."""
        now, mono = time.time(), time.monotonic()
        doomed = [x for x in list(self._live.values()) if mono >= x.ends_at]
        for live in doomed:
            log.info("sandbox %s of %s: ttl ended, destroying it", live.record.sandbox_id, live.tenant)
            self._forget(live, "EXPIRED", "its ttl ended")
        for tenant, ended in list(self._ended.items()):
            while ended and now - next(iter(ended.values())).ended_at > TOMBSTONE_KEEP_S:
                ended.popitem(last=False)
            if not ended:
                del self._ended[tenant]
        return doomed

    def _destroying_behind(self, doomed: Sequence[_Live]) -> asyncio.Future[None]:
        """Their removal, as a task close_all awaits."""
        task = asyncio.ensure_future(self._destroy_all(doomed))
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)
        return task

    async def _destroy_all(self, doomed: Sequence[_Live]) -> None:
        """Destroy them, DESTROY_CONCURRENCY at a time (one after another, one tenant's many expired sandboxes
        held the next reap, and the health checks behind it, for seconds each)."""
        turns = asyncio.Semaphore(DESTROY_CONCURRENCY)

        async def one(live: _Live) -> None:
            async with turns:
                await self._destroy(live)

        await asyncio.gather(*(one(x) for x in doomed))

    async def end_dead(self) -> int:
        """Health-check the sandboxes due one (each every probe_interval_s) and end those whose container died;
        returns how many were ended."""
        now = time.monotonic()
        due = [x for x in self._live.values() if now >= x.probe_at]
        for x in due:
            x.probe_at = now + self.config.probe_interval_s
        outcomes = await each_checked(due, self._end_if_dead, lambda x: f"sandbox {x.record.sandbox_id}")
        return sum(outcome is True for outcome in outcomes)

    async def _end_if_dead(self, live: _Live) -> bool:
        """End the sandbox if its container died (health.died); no verdict keeps it."""
        reason = await died(live.sandbox, live.record.sandbox_id)
        if reason is None or live.record.sandbox_id not in self._live:
            return False
        await self._died(live, reason)
        return True

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            try:
                await self.reap()
                await self.end_dead()
            except Exception:
                log.exception("sandbox reaper failed")

    async def close_all(self) -> None:
        """Stop the reaper and destroy every sandbox."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        live, self._live = list(self._live.values()), {}
        for x in live:
            if x.reservation is not None:
                x.reservation.release()
        await asyncio.gather(*(x.sandbox.close() for x in live), *self._destroying, return_exceptions=True)
