"""The docker backend's settings, one pydantic model (`type: "docker"`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    socket_tmpfs: bool = Field(
        True, description="each socket directory is a 64 KiB tmpfs (needs CAP_SYS_ADMIN), so no sandbox fills the disk"
    )
    nofile: int = Field(4096, ge=64, le=1 << 20, description="open files per sandbox process (the nofile ulimit)")
    api_workers: int = Field(
        16, ge=1, le=256, description="threads (and HTTP connections) for engine calls; the most in flight at once"
    )
    api_timeout_s: float = Field(120.0, gt=0)
    sweep_interval_s: float = Field(30.0, gt=0)
    health_interval_s: float = Field(1.0, gt=0, description="how often the engine is pinged")
    health_timeout_s: float = Field(2.0, gt=0, description="a ping slower than this marks the engine unhealthy")
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
