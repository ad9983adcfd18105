"""Server-side caps per request and per tenant: what one sandbox may ask for, how many jobs and streams a tenant may
hold at once, how many rollouts one job may have, how many bytes of results a tenant's jobs may keep in the result
log, how much exec stdin may be in flight.

Every refusal is RESOURCE_EXHAUSTED (QuotaExceededError) and names the cap by its configuration path (`caps.<field>`),
so an operator knows which setting to raise and a tenant knows what it ran into. One of a cap on what is held only
for a while (streams, Execs, stdin in flight) carries RetryInfo (BusyError): it may succeed once one ends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.core.archives import ArchiveLimits
from orchestrator.core.echo import echo
from orchestrator.core.environment import Environment
from orchestrator.core.errors import BusyError, InvalidRequestError, QuotaExceededError
from orchestrator.core.sandbox import Limits


class SandboxCaps(BaseModel):
    """The most one sandbox may ask for (raw sandboxes, declarative specs, sessions and rollouts alike)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int = Field(16 << 10, ge=16, le=1 << 20)
    cpus: float = Field(16.0, gt=0, le=1024)
    pids: int = Field(4096, ge=8, le=1 << 22)
    tmp_mb: int = Field(4 << 10, ge=1, le=1 << 20)
    workspace_mb: int = Field(16 << 10, ge=1, le=1 << 20)
    # A tenant that names a runtime picks its isolation: only these, never a weaker one than the server's default
    # (`envfleet serve --runtime`), which an empty runtime always gets. An unlisted one is INVALID_ARGUMENT.
    runtimes: tuple[str, ...] = Field(("runsc",), description="OCI runtimes a sandbox may name")


# A worker unpacks what its control plane already checked: under the widest caps an operator may set.
WIDEST_ARCHIVE_LIMITS = ArchiveLimits(members=1_000_000, unpacked_bytes=16 << 30, member_bytes=1 << 30)


class ArchiveCaps(BaseModel):
    """The most one uploaded environment archive (EnvironmentService.RegisterArchive) may hold, and a tenant store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bytes: int = Field(32 << 20, ge=1 << 10, le=63 << 20, description="the archive as sent (it fits one message)")
    unpacked_bytes: int = Field(256 << 20, ge=1 << 10, le=WIDEST_ARCHIVE_LIMITS.unpacked_bytes, description="all")
    member_bytes: int = Field(16 << 20, ge=1 << 10, le=WIDEST_ARCHIVE_LIMITS.member_bytes, description="one file")
    members: int = Field(10_000, ge=1, le=WIDEST_ARCHIVE_LIMITS.members, description="files, folders and links")
    bytes_per_tenant: int = Field(1 << 30, ge=1 << 10, le=1 << 40, description="archives a tenant keeps registered")

    def limits(self) -> ArchiveLimits:
        """What unpacking one archive may produce."""
        return ArchiveLimits(members=self.members, unpacked_bytes=self.unpacked_bytes, member_bytes=self.member_bytes)


class CapsConfig(BaseModel):
    """Caps per request and per tenant (`caps:` in the server configuration)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sandbox: SandboxCaps = SandboxCaps()
    archive: ArchiveCaps = ArchiveCaps()
    jobs_per_tenant: int = Field(64, ge=1, le=100_000, description="unfinished jobs per tenant")
    finished_jobs_per_tenant: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="finished jobs a tenant keeps within their retention; past it, its oldest go early (a stream "
        "that reads one keeps it)",
    )
    streams_per_tenant: int = Field(
        64, ge=1, le=100_000, description="open StreamRollouts streams per tenant, and apart from them open Execs"
    )
    rollouts_per_job: int = Field(1_000_000, ge=1, le=1_000_000, description="tasks x group_size of one job")
    result_bytes_per_tenant: int = Field(
        64 << 30,
        ge=1 << 10,
        le=1 << 50,
        description="bytes a tenant's jobs hold in the result log (each rollout's JSON and wire form; a job's go at "
        "its removal). Past it its oldest finished jobs wholly acked that no stream reads go early, where that brings "
        "it under; where it does not, a job that logs a rollout is cancelled (its stream ends RESOURCE_EXHAUSTED once "
        "all it logged is sent) and SubmitJob is refused",
    )
    calls_per_tenant: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="calls a tenant has in flight at once, streams included; past it a call is refused busy (each "
        "waiting call holds 9-15 KB of the server, however little it asks for)",
    )
    spec_bytes_per_tenant: int = Field(
        512 << 20, ge=1 << 10, le=1 << 40, description="declarative specs a tenant keeps registered (their JSON)"
    )
    environments_per_tenant: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="environments a tenant keeps registered, specs and archives, each version one: every tenant's "
        "List answers the public ones whole, and 12,500 of one tenant's took it past the message limit for all",
    )
    registration_check_s: float = Field(
        7200.0,
        ge=1,
        le=7 * 86400,
        allow_inf_nan=False,
        description="the longest one Validate or Register may check for in all (image build, reference runs, an "
        "archive's every task); the time budgets a spec gives its steps count within it",
    )
    exec_stdin_bytes: int = Field(16 << 20, ge=0, le=64 << 20, description="stdin of one Exec")
    read_bytes_per_tenant: int = Field(
        256 << 20,
        ge=1 << 10,
        le=1 << 36,
        description="ReadFile and Download replies a tenant has in flight, each counted at its cap while it is read "
        "and at its size until it is sent (a client that never reads holds them); past it a call waits its turn. "
        "List replies (List, ListJobs, a sandboxes' List) not read yet have a budget of this size of their own, "
        "past which a list call is refused busy",
    )
    stdin_bytes_per_tenant: int = Field(64 << 20, ge=0, le=1 << 32, description="Exec stdin in flight per tenant")
    write_bytes_per_tenant: int = Field(
        256 << 20,
        ge=1 << 10,
        le=1 << 36,
        description="WriteFile and Upload bytes in flight per tenant: a call past it is refused (busy), its message let"
        " go at once (each call holds its content about four times over until envd has it)",
    )


def check_limits(limits: Limits, caps: SandboxCaps, what: str = "limits", runtime: str = "") -> None:
    """Refuse limits over the caps, naming each one that is, and a runtime the caps do not list."""
    if runtime and runtime not in caps.runtimes:
        allowed = ", ".join(caps.runtimes) or "none"
        raise InvalidRequestError(
            f"runtime {echo(runtime)} is not allowed; caps.sandbox.runtimes allows: {allowed} (leave runtime empty "
            "for the server's default)"
        )
    over = [
        f"{what}.{name} = {getattr(limits, name):g} is over caps.sandbox.{name} = {getattr(caps, name):g}"
        for name in Limits.model_fields
        if getattr(limits, name) > getattr(caps, name)
    ]
    if over:
        raise QuotaExceededError("; ".join(over))


def check_env_limits(env: Environment, caps: SandboxCaps) -> None:
    """check_limits for the sandboxes of environment `env` (its limits and runtime), named by its ref."""
    check_limits(env.limits, caps, f"{env.ref()}: limits", env.runtime)


class TenantCounter:
    """How many of one kind of thing (streams, stdin bytes) each tenant holds now, refused past a cap."""

    def __init__(self, cap: int, cap_name: str, unit: str) -> None:
        self.cap = cap
        self.cap_name = cap_name
        self.unit = unit
        self._held: collections.Counter[str] = collections.Counter()

    def held(self, tenant: str) -> int:
        """What `tenant` holds now."""
        return self._held[tenant]

    def check(self, tenant: str, amount: int = 1, *, frees: bool = False) -> None:
        """QuotaExceededError when `amount` more would take the tenant over the cap; with `frees` (what is held
        only for a while: a stream, an Exec), BusyError, worth asking again, unless `amount` alone is over it."""
        if self._held[tenant] + amount > self.cap:
            error = BusyError if frees and amount <= self.cap else QuotaExceededError
            raise error(
                f"{self._held[tenant]} {self.unit} held and {amount} more asked for; "
                f"{self.cap_name} is {self.cap} per tenant"
            )

    def add(self, tenant: str, amount: int) -> None:
        """Count `amount` more for good: what the tenant keeps, not what it holds for a while (see `hold`)."""
        self._held[tenant] += amount

    @contextlib.contextmanager
    def hold(self, tenant: str, amount: int = 1) -> Iterator[None]:
        """Hold `amount` for the duration; BusyError when it would take the tenant over the cap (QuotaExceededError
        when `amount` alone is)."""
        self.check(tenant, amount, frees=True)
        self._held[tenant] += amount
        try:
            yield
        finally:
            self._held[tenant] -= amount
            if not self._held[tenant]:
                del self._held[tenant]  # the map stays as small as the tenants at work


class TenantBytes:
    """Bytes each tenant may hold at once (file replies in flight), in turns: a call past the cap waits until what
    the tenant holds leaves it room (first come, first served); one that could never fit is refused at once."""

    def __init__(self, cap: int, cap_name: str, unit: str) -> None:
        self.cap = cap
        self.cap_name = cap_name
        self.unit = unit
        self._held: collections.Counter[str] = collections.Counter()
        self._waiting: dict[str, collections.deque[tuple[int, asyncio.Future[None]]]] = {}

    def held(self, tenant: str) -> int:
        """What `tenant` holds now."""
        return self._held[tenant]

    async def take(self, tenant: str, amount: int) -> Taken:
        """`amount` bytes of the tenant's, once they fit; release (or shrink) the returned hold."""
        if amount > self.cap:
            raise QuotaExceededError(
                f"{amount} {self.unit} asked for at once; {self.cap_name} is {self.cap} per tenant (ask for less)"
            )
        queue = self._waiting.get(tenant)
        if queue or self._held[tenant] + amount > self.cap:
            turn = asyncio.get_running_loop().create_future()
            queue = self._waiting.setdefault(tenant, collections.deque())
            queue.append((amount, turn))
            try:
                await turn  # granted: counted already, by _wake
            except BaseException:
                if turn.done() and not turn.cancelled():
                    self._give_back(tenant, amount)  # granted, then cancelled before it was used
                else:
                    # its turn was cancelled with its task; _wake may have dropped it from the line meanwhile
                    with contextlib.suppress(ValueError):
                        queue.remove((amount, turn))
                    if not queue and self._waiting.get(tenant) is queue:
                        del self._waiting[tenant]
                    self._wake(tenant)  # a large call that left the head of the line lets the next ones in
                raise
        else:
            self._held[tenant] += amount
        return Taken(self, tenant, amount)

    def _give_back(self, tenant: str, amount: int) -> None:
        self._held[tenant] -= amount
        if not self._held[tenant]:
            del self._held[tenant]
        self._wake(tenant)

    def _wake(self, tenant: str) -> None:
        queue = self._waiting.get(tenant)
        while queue:
            amount, turn = queue[0]
            if turn.done():  # cancelled with its task, which has not run its way out of the line yet
                queue.popleft()
                continue
            if self._held[tenant] + amount > self.cap:
                break
            queue.popleft()
            self._held[tenant] += amount
            turn.set_result(None)
        if queue is not None and not queue:
            del self._waiting[tenant]
        if not self._held[tenant]:
            del self._held[tenant]


class Taken:
    """Bytes a tenant holds from a TenantBytes until `release()` (idempotent); `shrink(n)` keeps only n of them."""

    def __init__(self, budget: TenantBytes, tenant: str, amount: int) -> None:
        self._budget = budget
        self._tenant = tenant
        self.amount = amount

    def shrink(self, amount: int) -> None:
        """Keep `amount` (less than held) until the release: a reply smaller than its cap."""
        if 0 <= amount < self.amount:
            self._budget._give_back(self._tenant, self.amount - amount)
            self.amount = amount

    def release(self) -> None:
        """Give back what is held (once)."""
        if self.amount:
            self._budget._give_back(self._tenant, self.amount)
            self.amount = 0
