"""What a worker process is started with: the sandbox backend and warm pool it owns, and how often it checks in."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.backends.config import BackendConfig, DockerBackendConfig
from orchestrator.backends.pool import PoolConfig
from orchestrator.core.tracing import TracingConfig

MAX_SLOTS = 100_000  # rollouts one worker may say it runs at once
MAX_ENGINE_WAIT_S = 86_400.0  # the longest wait for its engine a worker may say its rollouts take
MAX_NAME_CHARS = 256
NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._:@-]{{0,{MAX_NAME_CHARS - 1}}}")  # a worker's id and its host's name


class WorkerConfig(BaseModel):
    """A worker's configuration, handed over by the control plane (or a Ray launch) as JSON."""

    model_config = ConfigDict(extra="forbid")

    backend: BackendConfig = Field(default_factory=lambda: DockerBackendConfig(owner="envfleet-orchestrator"))
    pool: PoolConfig = PoolConfig()
    slots: int = Field(64, ge=1, le=MAX_SLOTS, description="rollouts this worker expects to run at once")
    heartbeat_s: float = Field(1.0, gt=0, le=60)
    host: str | None = Field(
        None,
        pattern=f"^{NAME.pattern}$",
        description="the sandbox host this worker says it runs on: workers that share one container engine, and so "
        "its images, name one host, and the control plane moves the rollouts waiting for a host's engine that is "
        "down to another host's workers; none: this machine's hostname (a second engine on one machine, or workers "
        "in containers that share the node's engine, name theirs here)",
    )
    orphan_after_s: float | None = Field(
        None,
        gt=0,
        description="a worker with no session to its control plane for this long ends (a Ray actor whose control "
        "plane never came back on its data directory); none: it waits for ever",
    )
    metrics_s: float = Field(5.0, gt=0, le=300, description="how often a heartbeat carries the worker's metrics")
    host_share: int = Field(
        1,
        ge=1,
        le=1024,
        description="worker processes on this host: each holds its share of the group snapshots' memory",
    )
    tracing: TracingConfig = Field(TracingConfig(), description="where this worker exports its spans; off by default")
    environments: list[str] = Field(
        default_factory=list, description="module:ClassName environments to load beside the entry points"
    )
    tokenizer_dirs: list[Path] = Field(
        default_factory=list, description="where tito jobs' tokenizers are, by folder name (the control plane's own)"
    )
