"""Server-side caps per request and per tenant: what one sandbox may ask for, how many jobs and streams a tenant may
hold at once, how many rollouts one job may have, how much exec stdin may be in flight.

Every refusal is RESOURCE_EXHAUSTED (QuotaExceededError) and names the cap by its configuration path (`caps.<field>`),
so an operator knows which setting to raise and a tenant knows what it ran into.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.core.archives import ArchiveLimits
from orchestrator.core.echo import echo
from orchestrator.core.errors import InvalidRequestError, QuotaExceededError
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
    spec_bytes_per_tenant: int = Field(
        512 << 20, ge=1 << 10, le=1 << 40, description="declarative specs a tenant keeps registered (their JSON)"
    )
    exec_stdin_bytes: int = Field(16 << 20, ge=0, le=64 << 20, description="stdin of one Exec")
    stdin_bytes_per_tenant: int = Field(64 << 20, ge=0, le=1 << 32, description="Exec stdin in flight per tenant")


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

    def check(self, tenant: str, amount: int = 1) -> None:
        """QuotaExceededError when `amount` more would take the tenant over the cap."""
        if self._held[tenant] + amount > self.cap:
            raise QuotaExceededError(
                f"{self._held[tenant]} {self.unit} held and {amount} more asked for; "
                f"{self.cap_name} is {self.cap} per tenant"
            )

    def add(self, tenant: str, amount: int) -> None:
        """Count `amount` more for good: what the tenant keeps, not what it holds for a while (see `hold`)."""
        self._held[tenant] += amount

    @contextlib.contextmanager
    def hold(self, tenant: str, amount: int = 1) -> Iterator[None]:
        """Hold `amount` for the duration; QuotaExceededError when it would take the tenant over the cap."""
        self.check(tenant, amount)
        self._held[tenant] += amount
        try:
            yield
        finally:
            self._held[tenant] -= amount
            if not self._held[tenant]:
                del self._held[tenant]  # the map stays as small as the tenants at work
