"""The gRPC health check says SERVING only while the server can do work: a scheduler whose loop died (no rollout
starts again) said SERVING, so nothing restarted the process; an engine that stopped answering while the server was
still starting was heard by nobody. Real gRPC and scheduler on the fake backend."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.backends.docker.backend import DockerBackend
from tests.conftest import TEST_OWNER
from tests.orchestrator.servers import serve


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(r.status)


async def test_a_scheduler_that_died_is_not_serving(tmp_path: Path) -> None:
    async with serve(tmp_path, backend=FakeBackendConfig(owner=TEST_OWNER)) as orch:
        assert await _health(orch.address) == health_pb2.HealthCheckResponse.SERVING
        scheduler = orch.jobs.scheduler

        def broken() -> None:
            raise RuntimeError("a scheduler bug")

        scheduler._next = broken  # type: ignore[method-assign,assignment]
        scheduler.kick()
        for _ in range(200):
            if await _health(orch.address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.05)
        assert await _health(orch.address) == health_pb2.HealthCheckResponse.NOT_SERVING


def test_an_engine_already_down_is_told_to_a_late_listener() -> None:
    backend = DockerBackend.__new__(DockerBackend)  # only the listener bookkeeping: no engine
    backend._health_listeners, backend.engine_healthy = [], True
    heard: list[bool] = []
    backend.on_engine_health(heard.append)
    assert heard == []  # answering: nothing to say until it changes
    backend.engine_healthy = False
    backend.on_engine_health(heard.append)
    assert heard == [False]
