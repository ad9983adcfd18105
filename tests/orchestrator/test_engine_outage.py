"""The docker engine goes away and comes back (a dockerd restarting) under a job: a relay in front of the real
engine's socket is taken down (nothing listens, calls in flight are cut) and brought back. Rollouts wait for the
engine (DockerBackendConfig.engine_outage_wait_s) before a retry rather than spend their infrastructure retries on
it; a wait has an end, and after it they fail as before, masked, never a reward."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
from orchestrator.backends.pool import PoolConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import RolloutStatus
from orchestrator.testing.engine_relay import EngineRelay
from orchestrator.testing.scripted_policy import ScriptedServer
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.hub import WorkerInfo
from orchestrator.worker.spawn import LocalWorkers
from tests.conftest import TEST_OWNER, owned_containers, until
from tests.orchestrator.conftest import job
from tests.orchestrator.servers import serve, until_done

pytestmark = pytest.mark.docker
# the engine call limiter's pause of new calls after an unanswered one (5 s by default): with its default, three
# attempts rode out some 15 s of an outage before the wait, and a test of it would need a longer one
BACKOFF_S = 0.5


@pytest.fixture
async def relay(tmp_path: Path) -> AsyncIterator[EngineRelay]:
    r = EngineRelay(tmp_path / "engine.sock")
    try:
        await r.up()
        yield r
    finally:
        await r.close()


def _through(relay: EngineRelay, wait_s: float) -> dict[str, Any]:
    """A server whose engine is reached through `relay`; no warm pool (its sandboxes would ride through an outage,
    and no rollout would need the engine)."""
    backend = DockerBackendConfig(
        owner=TEST_OWNER, base_url=relay.url, engine_outage_wait_s=wait_s, api_max_backoff_s=BACKOFF_S
    )
    return {"backend": backend, "pool": PoolConfig(enabled=False)}


async def test_an_engine_restarting_mid_job_is_waited_for_and_fails_no_rollout(
    tmp_path: Path, base_image: str, relay: EngineRelay, slow_policy: ScriptedServer, task_ids: list[str]
) -> None:
    """Down 6 s under a job of 12 rollouts, 3 at a time: with no wait (engine_outage_wait_s 0, the code before it),
    rollouts that started meanwhile spent their three attempts on it and were INFRA_ERRORs."""
    async with serve(tmp_path / "data", **_through(relay, wait_s=60)) as orch, EnvfleetClient(orch.address) as c:
        job_id = await c.submit(job(slow_policy.url, task_ids[:6], n=2, max_concurrency=3))
        await until_done(c, job_id, 2, timeout_s=60, poll_s=0.05)
        await relay.down()
        await asyncio.sleep(6.0)
        await relay.up()
        rollouts = [r async for r in c.rollouts(job_id)]
        # the sandboxes whose removal the outage refused are removed once the engine answers again (its sweep), not
        # at the server's stop, nor at their lease's end an hour on
        assert isinstance(orch.backend, DockerBackend)
        instance = orch.backend.owner.instance
        left = await asyncio.to_thread(owned_containers, instance=instance)
        for _ in range(100):
            if not left:
                break
            await asyncio.sleep(0.2)
            left = await asyncio.to_thread(owned_containers, instance=instance)
        assert not left, [c.name for c in left]
    assert len(rollouts) == 12
    failed = [(r.id, r.status, r.error) for r in rollouts if r.status != RolloutStatus.OK or r.reward != 1.0]
    assert not failed, failed
    waited = sorted(r.metrics["engine_outage_s"] for r in rollouts)
    assert waited[-1] > 3.0, waited  # some rollouts were held by the outage, and say how long
    assert all(r.attempts <= 2 for r in rollouts), [r.attempts for r in rollouts]


async def test_an_engine_down_for_good_fails_rollouts_as_infrastructure_once_the_wait_is_spent(
    tmp_path: Path, base_image: str, relay: EngineRelay, slow_policy: ScriptedServer, task_ids: list[str]
) -> None:
    """The wait is a rollout's, in all its attempts: then the rollout is INFRA_ERROR, masked, as before the wait."""
    async with serve(tmp_path / "data", **_through(relay, wait_s=2)) as orch, EnvfleetClient(orch.address) as c:
        await relay.down()
        job_id = await c.submit(job(slow_policy.url, task_ids[:2], max_concurrency=2))
        rollouts = [r async for r in c.rollouts(job_id)]
        await relay.up()  # for the server's stop: it removes what it holds
    assert [r.status for r in rollouts] == [RolloutStatus.INFRA_ERROR] * 2, [(r.status, r.error) for r in rollouts]
    assert all(r.reward is None and r.attempts == 3 for r in rollouts)
    total = [r.finished_at - r.started_at for r in rollouts]
    assert all(2.0 <= t < 30.0 for t in total), total  # it waited its 2 s, and no longer than a few retries past it


async def test_warm_sandboxes_serve_rollouts_while_the_engine_is_down_without_a_wait(
    tmp_path: Path, base_image: str, relay: EngineRelay, slow_policy: ScriptedServer, task_ids: list[str]
) -> None:
    """A warm sandbox needs no engine (envd is reached by its own socket), so a rollout's first attempt is not held
    for one found down: a first job leaves its recycled sandboxes warm, and a second one, run with the engine gone,
    runs on them at once."""
    backend = DockerBackendConfig(owner=TEST_OWNER, base_url=relay.url, engine_outage_wait_s=60)
    async with serve(tmp_path / "data", backend=backend) as orch, EnvfleetClient(orch.address) as c:
        first = [r async for r in c.rollouts(await c.submit(job(slow_policy.url, task_ids[:2], max_concurrency=2)))]
        assert [r.status for r in first] == [RolloutStatus.OK] * 2, [(r.status, r.error) for r in first]
        await relay.down()
        engine = orch.backend
        assert isinstance(engine, DockerBackend)
        await until(lambda: not engine.engine_healthy, "the engine's pinger found it gone", limit_s=10)
        assert not engine.engine_healthy and not engine.engine.answering.is_set()
        try:
            second = [
                r async for r in c.rollouts(await c.submit(job(slow_policy.url, task_ids[2:4], max_concurrency=2)))
            ]
        finally:
            await relay.up()
    assert [(r.status, r.reward, r.attempts) for r in second] == [(RolloutStatus.OK, 1.0, 1)] * 2, [
        (r.status, r.error) for r in second
    ]
    assert [r.metrics["sandbox_warm"] for r in second] == [1.0, 1.0]
    assert [r.metrics["engine_outage_s"] for r in second] == [0.0, 0.0]


async def test_a_worker_process_says_its_engine_is_down_and_back_in_its_heartbeats(
    tmp_path: Path, base_image: str, relay: EngineRelay
) -> None:
    """The control plane places new rollouts on workers whose engine answers (WorkerHub._placement): a real worker
    process says what its own engine does, in its hello and then heartbeat by heartbeat, and its metrics (on the
    control plane's endpoint, labelled with it) say it too."""

    def gauge() -> list[float]:
        name = b"envfleet_docker_engine_answering "
        lines = [line for _, _, text in hub.metric_snapshots() for line in text.splitlines() if line.startswith(name)]
        return [float(line.removeprefix(name)) for line in lines]

    async with serve(tmp_path / "data", workers=1, **_through(relay, wait_s=60)) as orch:
        assert orch.workers is not None
        hub = orch.workers.hub
        await hub.wait_for_workers(1, timeout_s=120)
        assert [w.engine_down for w in hub.workers()] == [False]  # its hello said so
        await until(lambda: gauge() == [1.0], "its gauge at 1", limit_s=30)  # its metrics go every 5 s
        await relay.down()
        try:
            await until(lambda: [w.engine_down for w in hub.workers()] == [True], "said down", limit_s=30)
            await until(lambda: gauge() == [0.0], "its gauge at 0", limit_s=30)
        finally:
            await relay.up()
        await until(lambda: [w.engine_down for w in hub.workers()] == [False], "said back", limit_s=30)


async def test_a_worker_process_says_which_rollouts_wait_for_its_engine(
    tmp_path: Path, base_image: str, relay: EngineRelay, slow_policy: ScriptedServer, task_ids: list[str]
) -> None:
    """What the control plane moves to another host's worker (WorkerHub._move_waiting, test_worker_wire.py): a real
    worker process's rollouts whose retry waits for its engine are said in its heartbeats, and run once it is back."""
    async with (
        serve(tmp_path / "data", workers=1, **_through(relay, wait_s=60)) as orch,
        EnvfleetClient(orch.address) as c,
    ):
        assert orch.workers is not None
        hub = orch.workers.hub
        await hub.wait_for_workers(1, timeout_s=120)
        await relay.down()
        try:
            job_id = await c.submit(job(slow_policy.url, task_ids[:2], max_concurrency=2))
            await until(lambda: [w.engine_waits for w in hub.workers()] == [2], "both said to wait", limit_s=60)
        finally:
            await relay.up()
        rollouts = [r async for r in c.rollouts(job_id)]
    assert [(r.status, r.reward) for r in rollouts] == [(RolloutStatus.OK, 1.0)] * 2, [r.error for r in rollouts]
    assert all(r.metrics["engine_outage_s"] > 0 for r in rollouts)


async def test_rollouts_waiting_for_a_hosts_engine_move_to_another_host_and_none_waits_it_out(
    tmp_path: Path,
    base_image: str,
    slow_policy: ScriptedServer,
    task_ids: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two sandbox hosts, each with its own engine (WorkerConfig.host; a relay apiece in front of this machine's
    engine), a real worker process on each. Host a's engine goes down for good: rollouts placed on a (the other host
    full) wait for it, say so in a's heartbeats, and the control plane moves them to b once b has room. They would
    otherwise wait out a's engine_outage_wait_s of 10 minutes, past this test's limits. New rollouts then go to b."""
    caplog.set_level(logging.INFO, logger="orchestrator.worker.hub")
    relays = {name: EngineRelay(tmp_path / f"{name}.sock") for name in ("a", "b")}
    settings: dict[str, Any] = {"workers": 0, "worker_listen": "127.0.0.1:0"}  # remote workers only
    try:
        for r in relays.values():
            await r.up()
        async with serve(tmp_path / "data", **settings) as orch, EnvfleetClient(orch.address) as c:
            plane = orch.workers
            assert plane is not None and plane.tcp_address is not None
            fleet: dict[str, LocalWorkers] = {}
            for name, relay in relays.items():
                config = WorkerConfig(host=f"host-{name}", slots=2, **_through(relay, wait_s=600))
                fleet[name] = LocalWorkers(1, plane.tcp_address, plane.token, config)
            try:
                for workers in fleet.values():
                    workers.start()
                hub = plane.hub
                await hub.wait_for_workers(2, timeout_s=120)
                assert sorted(w.host for w in hub.workers()) == ["host-a", "host-b"]
                await relays["a"].down()

                def says(host: str) -> WorkerInfo | None:
                    return next((w for w in hub.workers() if w.host == host), None)

                await until(lambda: getattr(says("host-a"), "engine_down", False), "a said it is down", limit_s=30)
                # b's two slots take two of the four (its engine answers); a takes the other two, b being full, and
                # they wait for its engine until they are moved (each then counts an attempt)
                job_id = await c.submit(job(slow_policy.url, task_ids[:4], max_concurrency=4))
                done = await until_done(c, job_id, 4, timeout_s=120)
                assert done == 4, f"{done} of 4 done in 2 minutes: those waiting for a's engine were not moved"
                rollouts = [r async for r in c.rollouts(job_id)]
                assert [(w.host, w.served, w.engine_down) for w in sorted(hub.workers(), key=lambda w: w.host)] == [
                    ("host-a", 0, True),
                    ("host-b", 4, False),
                ]
                # moved, not lost with its worker (whose rollouts go to b alike, and count an attempt alike)
                assert (hub.lost, [w.restarts for w in fleet.values()]) == (0, [0, 0])
                moves = [re.match(r"moved (\d+) rollouts waiting for worker", r.getMessage()) for r in caplog.records]
                assert sum(int(m[1]) for m in moves if m) == 2, caplog.text
                # with room on b, new rollouts go there, not to a's down engine: none waits there to be moved
                second = await c.submit(job(slow_policy.url, task_ids[4:6], max_concurrency=2))
                after = [r async for r in c.rollouts(second)]
                assert [(r.status, r.attempts) for r in after] == [(RolloutStatus.OK, 1)] * 2, [r.error for r in after]
                assert [w.served for w in sorted(hub.workers(), key=lambda w: w.host)] == [0, 6]
            finally:
                await asyncio.gather(*(w.stop() for w in fleet.values()), return_exceptions=True)
    finally:
        for r in relays.values():
            await r.close()
    assert sorted(r.task_id for r in rollouts) == sorted(task_ids[:4])
    assert [(r.status, r.reward) for r in rollouts] == [(RolloutStatus.OK, 1.0)] * 4, [r.error for r in rollouts]
    assert sorted(r.attempts for r in rollouts) == [1, 1, 2, 2]  # a's two, moved
    left = await asyncio.to_thread(owned_containers)
    assert not left, [c.name for c in left]
