"""One pydantic config per sandbox backend, told apart by `type`, and `start_backend`, which imports the chosen
backend only when it starts one: the fake path never imports docker (the SWE-ReX deployment-config pattern)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from orchestrator.core.errors import ConfigError
from orchestrator.core.sandbox import RUNTIME_PATTERN

if TYPE_CHECKING:
    from orchestrator.core.sandbox import SandboxBackend


def _envd_default() -> Literal["go", "python"]:
    """$ENVFLEET_ENVD, read when a config is made (not at import: a bad value was a traceback of any command)."""
    value = os.environ.get("ENVFLEET_ENVD") or "go"
    if value not in ("go", "python"):
        raise ConfigError(f"$ENVFLEET_ENVD={value!r}: expected go or python")
    return "go" if value == "go" else "python"


class DockerBackendConfig(BaseModel):
    """Settings of the docker backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["docker"] = "docker"
    base_url: str | None = Field(None, description="engine address; DOCKER_HOST or the local socket when unset")
    owner: str = Field("envfleet", min_length=1, max_length=64, description="who owns the sandboxes (a label)")
    socket_root: Path = Field(
        Path("/run/envfleet"),
        description="envd's socket directories and the sweep's key: created 0700 and owned by us, not a world-writable"
        " place (a backend that shares it with others shares their sweep)",
    )
    seal_key_dir: Path | None = Field(
        None,
        description="where the socket root's key is kept across reboots (the root is under /run, a tmpfs); default: "
        "/var/lib/envfleet/seal-keys for root, else $XDG_STATE_HOME/envfleet/seal-keys",
    )
    allow_unlimited_swap: bool = Field(
        False,
        description="start on an engine that cannot limit swap (sandboxes may then swap past their memory limit)",
    )
    socket_tmpfs: bool = Field(
        True, description="each socket directory is a 64 KiB tmpfs (needs CAP_SYS_ADMIN), so no sandbox fills the disk"
    )
    runtime: str = Field(
        "",
        pattern=RUNTIME_PATTERN,
        description="OCI runtime of sandboxes whose spec names none (`--runtime runsc`: gVisor); empty: the engine's",
    )
    envd: Literal["go", "python"] = Field(
        default_factory=lambda: _envd_default(),
        description="which envd the sandboxes run: the compiled one (/opt/envfleet/bin/envd) or the Python one; "
        "both are in every image made from envfleet/base ($ENVFLEET_ENVD sets the default)",
    )
    nofile: int = Field(4096, ge=64, le=1 << 20, description="open files per sandbox process (the nofile ulimit)")
    # the host's ptys are one pool for every container (orchestrator/backends/docker/ptys.py)
    pty_max: int = Field(
        32,
        ge=0,
        le=1 << 20,
        description="pseudo-terminals a sandbox may hold at once (needs CAP_SYS_ADMIN and CAP_SYS_PTRACE); 0: the "
        "engine's devpts as it is, which lets one sandbox take the host's every pty",
    )
    api_workers: int = Field(
        16, ge=1, le=256, description="threads (and HTTP connections) for engine calls; the most in flight at once"
    )
    api_timeout_s: float = Field(120.0, gt=0)
    # A sandbox's start-up (engine create and start, then envd's Python start until its first health answer) is
    # mostly CPU: 256 of them at once on 2 cores each get 1/128 of a core, so all miss their health deadline together
    # and are retried, which only adds more. Bounded, each starts in a fraction of a second and the deadline counts
    # from its own turn; the host's throughput of start-ups is the same.
    startup_concurrency: int = Field(
        0,
        ge=0,
        le=1024,
        description="sandboxes starting at once (create until envd answers); 0: four per CPU core, at least 8",
    )
    # why execs are admitted a few at a time, and how long one holds its place: orchestrator/backends/admission.py
    exec_admission: int = Field(
        0,
        ge=0,
        le=4096,
        description="execs starting at once on this backend: an exec holds its place until it ends, or until it "
        "has run four times as long as execs here take (at most exec_admission_hold_s; a long command never holds "
        "the others back longer); 0: four per CPU core of the host, shared by the host's worker processes",
    )
    host_workers: int = Field(
        1,
        ge=1,
        le=4096,
        description="worker processes of this backend's host that share its defaults (the plane sets it)",
    )
    exec_admission_hold_s: float = Field(
        0.25, ge=0, le=60, description="the longest an exec holds its place; 0: no limit on execs at once"
    )
    sweep_interval_s: float = Field(30.0, gt=0)
    reaper: bool = Field(
        True,
        description="a detached watchdog per backend removes its sandboxes once its process is gone without closing "
        "it (SIGKILL, the OOM killer, a Ray worker dying with its raylet), where no other sweep may ever run",
    )
    health_interval_s: float = Field(1.0, gt=0, description="how often the engine is pinged")
    health_timeout_s: float = Field(2.0, gt=0, description="a ping slower than this marks the engine unhealthy")
    engine_outage_wait_s: float = Field(
        300.0,
        ge=0,
        le=86400,
        description="how long in all a rollout waits for the engine to answer again (a dockerd restarting) before "
        "an infrastructure retry, rather than spend its retries on it; 0: no wait",
    )
    # Fifty sandboxes at once peak near 75 engine calls/s here (the engine manages 4-5 creates/s; each sandbox is a
    # create, a start, a state check per second while it starts, a remove): 200/s never holds a healthy engine back
    # and stops only a runaway loop. A burst of 50 lets fifty creates begin at once.
    api_rate_per_s: float = Field(200.0, gt=0, description="engine calls started per second, at most")
    api_burst: int = Field(50, ge=1, description="engine calls that may start at once after a quiet spell")
    api_slow_factor: float = Field(
        3.0, gt=1, description="a call this many times slower than the recent average of its kind cuts the limit"
    )
    api_slow_min_s: float = Field(
        0.5, ge=0, description="calls quicker than this never count as slow (jitter on a busy host is no stall)"
    )
    api_max_backoff_s: float = Field(5.0, ge=0, description="longest pause of new calls while the engine fails")

    def exec_slots(self) -> int:
        """Execs starting at once (exec_admission, or its default: this host's, shared by its worker processes);
        0 when admission is off."""
        if self.exec_admission_hold_s <= 0:
            return 0
        return self.exec_admission or _share(EXECS_PER_CORE * (os.cpu_count() or 1), self.host_workers)

    def startup_slots(self) -> int:
        """Sandboxes starting at once (startup_concurrency, or its default: this host's, shared by its worker
        processes)."""
        return self.startup_concurrency or _share(max(8, 4 * (os.cpu_count() or 1)), self.host_workers)

    def shared_by(self, workers: int) -> DockerBackendConfig:
        """The backend of one of `workers` processes on a host: the execs and the sandbox start-ups at once split
        between them (rounded up, at least 2 each), so that the host starts what it was configured to, not that
        times its workers. A default is split where the backend runs (a Ray node's own cores, not the control
        plane's); a value set here is split now."""
        if workers <= 1:
            return self
        update: dict[str, int] = {"host_workers": workers}
        if self.startup_concurrency:
            update["startup_concurrency"] = _share(self.startup_concurrency, workers)
        if self.exec_admission:
            update["exec_admission"] = _share(self.exec_admission, workers)
        return self.model_copy(update=update)


def _share(total: int, workers: int) -> int:
    """One of `workers` processes' share of a host's `total`: rounded up, at least 2."""
    return total if workers <= 1 else max(2, -(-total // workers))


EXECS_PER_CORE = 4  # the default of exec_admission: the best of 2, 4 and 8 a core tried here (README)


class ExecRule(BaseModel):
    """A scripted answer of the fake backend: a command whose command line matches `match` gets this output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    match: str = Field(min_length=1, description="a regular expression, searched in the command line")
    stdout: str = ""
    stderr: str = ""
    exit_code: int = Field(0, ge=0, le=255)
    latency_s: float = Field(0.0, ge=0, le=24 * 3600, description="extra run time of a matching command")

    @field_validator("match")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return v


# A test's own exec behaviour for the fake backend: takes a FakeExec (orchestrator/backends/fake/machine.py) and
# returns an ExecResult, or an awaitable of one; raising a SandboxError simulates an infrastructure failure. Typed
# loosely here so that choosing a backend imports neither backend.
ExecHandler = Callable[[Any], Any]


class FakeBackendConfig(BaseModel):
    """Settings of the fake backend: in-process sandboxes with an in-memory filesystem and scripted or echoed
    command output, for control-plane tests and fleet simulations. What it scores means nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    type: Literal["fake"] = "fake"
    owner: str = Field("envfleet", min_length=1, max_length=64, description="who owns the sandboxes (a label)")
    create_latency_s: float = Field(0.0, ge=0, le=600, description="how long a create takes")
    exec_latency_s: float = Field(0.0, ge=0, le=600, description="how long every command runs")
    destroy_latency_s: float = Field(0.0, ge=0, le=600, description="how long a destroy takes")
    reset_latency_s: float = Field(0.0, ge=0, le=600, description="how long a reset in place takes")
    image_build_latency_s: float = Field(
        0.0, ge=0, le=3600, description="how long an environment's own image (one with an image spec) takes to build"
    )
    base_image: str = Field("envfleet/base:latest", min_length=1, description="the image of environments without one")
    images: tuple[str, ...] = Field((), description="more image tags that exist (for the raw sandbox API)")
    rules: tuple[ExecRule, ...] = Field((), description="scripted outputs, first match wins; others are echoed")
    exec_handler: ExecHandler | None = Field(
        None, exclude=True, description="in-process only (tests): decides every command's outcome, before the rules"
    )


BackendConfig = Annotated[DockerBackendConfig | FakeBackendConfig, Field(discriminator="type")]
_ADAPTER: TypeAdapter[DockerBackendConfig | FakeBackendConfig] = TypeAdapter(BackendConfig)


def parse_backend_config(raw: Mapping[str, Any]) -> DockerBackendConfig | FakeBackendConfig:
    """A backend config from plain data (a config file); every problem is named in one ConfigError."""
    try:
        return _ADAPTER.validate_python(dict(raw))
    except ValidationError as e:
        # a location starts with the backend's tag ("fake", "create_latency_s"); a bad tag has no location
        problems = "; ".join(f"{'.'.join(map(str, err['loc'][1:])) or 'type'}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid backend config: {problems}") from None


async def start_backend(config: DockerBackendConfig | FakeBackendConfig, *, sweep: bool = True) -> SandboxBackend:
    """A started backend of the configured type; its module is imported here, not before."""
    if isinstance(config, FakeBackendConfig):
        from orchestrator.backends.fake import FakeBackend

        return FakeBackend(config)
    from orchestrator.backends.docker.backend import DockerBackend

    return await DockerBackend.start(config, sweep=sweep)
