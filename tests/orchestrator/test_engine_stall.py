"""The docker daemon stalls (SIGSTOP for 10 s, then SIGCONT): calls time out, health says NOT_SERVING meanwhile,
rollouts are retried as INFRA_ERROR, and everything recovers."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.backends.docker.backend import DockerBackendConfig
from orchestrator.backends.pool import PoolConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import RolloutStatus
from orchestrator.server.app import OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.conftest import TEST_OWNER
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import until_done


def _dockerd_pid() -> int:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/comm") as f:
                    if f.read().strip() == "dockerd":
                        return int(name)
            except OSError:
                continue
    raise AssertionError("no dockerd running")


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(r.status)


async def test_engine_stall_then_recovery(tmp_path: Path, base_image: str, task_ids: list[str]) -> None:
    env = Registry.from_entry_points().get(ENV)
    policy = await start_scripted_server(reference_script(env, latency_s=0.3))
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path,
            backend=DockerBackendConfig(owner=TEST_OWNER, api_timeout_s=3, health_interval_s=0.5, health_timeout_s=1),
            # no warm pool: with one, recycled sandboxes ride through the stall and nothing would need the engine
            pool=PoolConfig(enabled=False),
        )
    )
    pid = _dockerd_pid()
    stopped = False
    try:
        assert await _health(orch.address) == health_pb2.HealthCheckResponse.SERVING
        async with EnvfleetClient(orch.address) as c:
            job_id = await c.submit(job(policy.url, task_ids[:6], max_concurrency=3, max_infra_retries=8))
            await until_done(c, job_id, 1, timeout_s=10, poll_s=0.05)
            os.kill(pid, signal.SIGSTOP)
            stopped = True
            seen_not_serving = False
            for _ in range(40):
                await asyncio.sleep(0.25)
                if await _health(orch.address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                    seen_not_serving = True
                    break
            assert seen_not_serving, "health should report NOT_SERVING while the engine is stopped"
            await asyncio.sleep(max(0.0, 10 - 0.25 * 40 / 4))
            os.kill(pid, signal.SIGCONT)
            stopped = False
            rollouts = [r async for r in c.rollouts(job_id)]
        assert len(rollouts) == 6
        assert all(r.status == RolloutStatus.OK and r.reward == 1.0 for r in rollouts), [
            (r.status, r.error) for r in rollouts
        ]
        assert any(r.attempts > 1 for r in rollouts), "creates during the stall should have failed and been retried"
        for _ in range(40):
            if await _health(orch.address) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.25)
        assert await _health(orch.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        await orch.stop()
        await policy.close()
