"""`create_server(config)`: the orchestrator process's parts wired together, serving gRPC."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.backends.docker import DockerBackend, DockerBackendConfig
from orchestrator.backends.pool import PoolConfig, SandboxPool
from orchestrator.jobs import JobManager
from orchestrator.metrics import Metrics
from orchestrator.registry import Registry
from orchestrator.rollout.runner import ImageResolver, RolloutRunner
from orchestrator.server.errors import ErrorInterceptor
from orchestrator.server.services import EnvironmentService, RolloutService
from orchestrator.store import ResultStore
from protos import orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


class OrchestratorConfig(BaseModel):
    """How an orchestrator serves."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535, description="0 picks a free port")
    data_dir: Path = Path(".envfleet")
    max_in_flight: int = Field(64, ge=1, le=100_000, description="rollouts in flight on this host")
    backend: DockerBackendConfig = DockerBackendConfig(owner="envfleet-orchestrator")
    reflection: bool = True
    pool: PoolConfig = PoolConfig()
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus endpoint; None: off")


class Orchestrator:
    """A running orchestrator: its gRPC server, jobs, store and sandbox backend."""

    def __init__(
        self,
        config: OrchestratorConfig,
        server: grpc.aio.Server,
        port: int,
        jobs: JobManager,
        backend: DockerBackend,
        store: ResultStore,
        health_servicer: health.aio.HealthServicer,
    ) -> None:
        self.config = config
        self.server = server
        self.port = port
        self.jobs = jobs
        self.backend = backend
        self.store = store
        self._health = health_servicer
        self.pool: SandboxPool | None = None
        self.metrics: Metrics | None = None
        self.metrics_port: int | None = None
        self._metrics_server: Any = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def wait(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self, grace: float = 5.0) -> None:
        """Stop serving, cancel running rollouts (destroying their sandboxes), close the store."""
        await self._health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.jobs.close()
        if self.pool is not None:
            await self.pool.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        await self.backend.close()
        await self.store.close()


async def create_server(config: OrchestratorConfig, registry: Registry | None = None) -> Orchestrator:
    """Open the store, sweep and start the backend, resume unfinished jobs, and serve."""
    store = await ResultStore.open(config.data_dir / "results.sqlite3")
    backend = await DockerBackend.start(config.backend)
    registry = registry or Registry.from_entry_points()
    metrics = Metrics()
    pool = SandboxPool(backend, config.pool, metrics)
    pool.start()
    runner = RolloutRunner(pool, ImageResolver(backend.client))
    jobs = await JobManager.start(store, registry, runner, config.max_in_flight, metrics=metrics)
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor()],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    orchestrator_pb2_grpc.add_EnvironmentServiceServicer_to_server(EnvironmentService(registry), server)
    orchestrator_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutService(jobs), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        names = [
            orchestrator_pb2.DESCRIPTOR.services_by_name[s].full_name for s in ("EnvironmentService", "RolloutService")
        ]
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("orchestrator serving on %s:%d (data in %s)", config.host, port, config.data_dir)
    orch = Orchestrator(config, server, port, jobs, backend, store, health_servicer)
    orch.pool, orch.metrics = pool, metrics
    if config.metrics_port is not None:
        orch._metrics_server, _ = start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
        orch.metrics_port = orch._metrics_server.server_port
        log.info("metrics on http://%s:%d/metrics", config.host, orch.metrics_port)
    return orch
