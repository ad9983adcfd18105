"""Frozen idle sandboxes on real Docker: a warm sandbox idle past freeze_idle_after_s stops costing CPU, any call
thaws it, and a frozen one is removed like any other (by close, and by the sweep's path after a crash)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import docker
import pytest

from bench.envd_bench import envd_pid
from bench.freeze_bench import threads_cpu_s
from orchestrator.backends.docker.backend import DockerBackend, DockerSandbox
from orchestrator.backends.pool import PoolConfig, SandboxPool
from orchestrator.core.sandbox import SandboxSpec
from tests.orchestrator.backends.test_call_limiter import until


def frozen_count(pool: SandboxPool) -> float:
    return pool.metrics.registry.get_sample_value("envfleet_pool_frozen") or 0.0


@pytest.fixture
async def sandbox(backend: DockerBackend, base_image: str) -> AsyncIterator[DockerSandbox]:
    sb = await backend.create(SandboxSpec(image=base_image))
    yield sb
    await sb.close()


async def test_a_frozen_sandbox_uses_no_cpu_and_any_call_thaws_it(
    sandbox: DockerSandbox, docker_client: docker.DockerClient
) -> None:
    envd = envd_pid(docker_client.api, sandbox.id)
    # the measure sees envd work: calls (the Python envd's gRPC threads also wake about once a second when idle; the
    # compiled one sleeps until a call comes)
    before = threads_cpu_s(envd)
    for _ in range(20):
        assert await sandbox.transport.health(timeout=5)
    assert threads_cpu_s(envd) > before
    assert sandbox.freeze()
    await asyncio.sleep(0.2)
    before = threads_cpu_s(envd)
    await asyncio.sleep(2.5)
    assert threads_cpu_s(envd) == before
    # not thawed, the call would wait out its deadline
    result = await asyncio.wait_for(sandbox.exec(["echo", "hi"]), timeout=10)
    assert result.stdout == b"hi\n"
    assert sandbox.freeze()
    assert (await asyncio.wait_for(sandbox.reset(), timeout=10)).ok


async def test_a_frozen_sandbox_is_removed_by_close_and_by_the_sweep_path(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    spec = SandboxSpec(image=base_image)
    closed, orphan = await asyncio.gather(backend.create(spec), backend.create(spec))
    assert closed.freeze() and orphan.freeze()
    await asyncio.wait_for(closed.close(), timeout=30)
    # what a sweep does to the containers of a crashed worker, which froze them and never thawed them
    await asyncio.wait_for(backend.discard(orphan.id, orphan.name), timeout=30)
    left = {c["Id"] for c in docker_client.api.containers(all=True)}
    assert closed.id not in left and orphan.id not in left
    await orphan.close()  # the backend's bookkeeping; the container is gone already


async def test_the_pool_freezes_idle_sandboxes_and_thaws_the_one_it_hands_out(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    pool = SandboxPool(backend, PoolConfig(freeze_idle_after_s=0.5, probe_idle_after_s=1))
    pool.start()
    try:
        spec = SandboxSpec(image=base_image)
        sb, _ = await pool.acquire(spec)
        assert await pool.release(sb, recycle=True)
        await until(lambda: frozen_count(pool) == 1, timeout_s=10)
        envd = envd_pid(docker_client.api, sb.id)
        before = threads_cpu_s(envd)
        await asyncio.sleep(2.5)
        assert threads_cpu_s(envd) == before
        again, source = await pool.acquire(spec)
        assert (again.id, source, frozen_count(pool)) == (sb.id, "warm", 0)
        # it was handed out thawed: the probe before the hand-out (idle past probe_idle_after_s) answered
        assert pool.metrics.registry.get_sample_value("envfleet_pool_probes_total", {"outcome": "alive"}) == 1
        assert (await asyncio.wait_for(again.exec(["echo", "hi"]), timeout=10)).stdout == b"hi\n"
        assert await pool.release(again, recycle=True)
        await until(lambda: frozen_count(pool) == 1, timeout_s=10)
    finally:
        await pool.close()  # destroys the frozen idle one; the leak check around the run would see it left
    assert frozen_count(pool) == 0


async def test_freezing_can_be_turned_off(backend: DockerBackend, base_image: str) -> None:
    pool = SandboxPool(backend, PoolConfig(freeze_idle_after_s=0))
    pool.start()
    try:
        sb, _ = await pool.acquire(SandboxSpec(image=base_image))
        assert await pool.release(sb, recycle=True)
        await asyncio.sleep(2.5)  # the refiller ran twice meanwhile
        assert frozen_count(pool) == 0
    finally:
        await pool.close()
