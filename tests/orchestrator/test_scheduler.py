"""Admission and fair share. The first tests drive the Scheduler alone (pure unit tests with a fake rollout); the
last ones go through a live orchestrator on the fake backend (placement is the control plane's; image builds are
simulated by the fake's build latency)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from environments.python_tool import PythonToolEnv
from orchestrator.backends.config import FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Task
from orchestrator.core.errors import CapacityError
from orchestrator.core.image_spec import ImageSpec
from orchestrator.core.policy import REPLAY_URL
from orchestrator.rollout.runner import WorkItem
from orchestrator.server.app import OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.service.scheduler import Capacity, Need, PendingItems, Scheduler
from orchestrator.testing.scripted_policy import start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.conftest import TEST_OWNER
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE


def _items(job_id: str, n: int) -> list[WorkItem]:
    return [WorkItem(job_id, Task(id=f"t{i}", prompt="p"), 0, 0.0) for i in range(n)]


async def _never(item: WorkItem) -> None:
    await asyncio.sleep(3600)


def test_pending_items_come_as_a_list_of_them_would_made_as_they_start() -> None:
    # a job's million items were built at its submit, on the event loop (1.5 s and 160 MB a SubmitJob, and a tenant
    # could submit and cancel such jobs at will): they are made as they start, in the order the list had
    tasks = [Task(id=f"t{i}", prompt="p") for i in range(4)]
    done = {"j:t0:1", "j:t2:0", "j:t3:2"}
    pending = PendingItems("j", tasks, 3, enqueued_at=5.0, tenant="ten", skip=done)
    assert len(pending) == 12 - 3 and pending._next == 0  # nothing made yet
    first = pending.popleft()
    assert (first.id, first.enqueued_at, first.tenant) == ("j:t0:0", 5.0, "ten") and len(pending) == 8
    extra = WorkItem("j", tasks[0], 9, 1.0)
    pending.extend([extra])  # made elsewhere: behind the rest, as a list's would be
    assert len(pending) == 9
    got = [pending.popleft().id for _ in range(len(pending))]
    expected = [f"j:{t.id}:{k}" for t in tasks for k in range(3) if f"j:{t.id}:{k}" not in done][1:]
    assert got == [*expected, "j:t0:9"] and not pending
    with pytest.raises(IndexError):
        pending.popleft()
    again = PendingItems("j", tasks, 3)
    with pytest.raises(TypeError):
        again.extend(PendingItems("j", tasks, 3))  # type: ignore[arg-type]
    again.clear()
    assert not again and len(again) == 0
    s = Scheduler(8, _never)
    queued = PendingItems("q", tasks, 2)
    s.add_job("q", 1, 1, queued)
    with pytest.raises(ValueError, match="queued already"):  # it would pop itself into itself for good
        s.add_job("q", 1, 1, queued)
    s.add_job("q", 1, 1, PendingItems("q", tasks[:1], 1))  # a second batch: behind the first
    assert len(s._queues["q"].pending) == 9


async def test_a_large_job_makes_its_items_as_they_start(tmp_path: Path) -> None:
    orch = await create_server(
        OrchestratorConfig(port=0, data_dir=tmp_path, backend=FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=5))
    )
    try:
        async with EnvfleetClient(orch.address) as client:
            ids = [t.id for t in PythonToolEnv().tasks()]
            job_id = await client.submit(job(REPLAY_URL, ids, n=1024, max_concurrency=2))
            for _ in range(100):
                if orch.jobs.scheduler.running_of(job_id) == 2:
                    break
                await asyncio.sleep(0.05)
            pending = orch.jobs.scheduler._queues[job_id].pending
            assert len(pending) == 60 * 1024 - 2 and pending._next == 2  # two made, the rest not yet
            await client.cancel_job(job_id)
    finally:
        await orch.stop(grace=1)


async def test_fair_share_follows_priority() -> None:
    started: list[str] = []
    running: dict[str, int] = {"a": 0, "b": 0}
    peak_ratio: list[float] = []

    async def run(item: WorkItem) -> None:
        started.append(item.job_id)
        running[item.job_id] += 1
        if running["a"] and running["b"]:
            peak_ratio.append(running["a"] / running["b"])
        await asyncio.sleep(0.02)
        running[item.job_id] -= 1

    s = Scheduler(8, run)
    s.start()
    s.add_job("a", priority=3, max_concurrency=100, items=_items("a", 60))
    s.add_job("b", priority=1, max_concurrency=100, items=_items("b", 60))
    for _ in range(500):
        if len(started) >= 80:
            break
        await asyncio.sleep(0.01)
    await s.close()
    first = started[:40]
    # with both queues full, job a (priority 3) gets three slots for each of b's
    assert 2.0 <= first.count("a") / max(first.count("b"), 1) <= 4.5, first
    assert max(peak_ratio) <= 7  # never starves b


class PeakCounter:
    """A fake rollout that records how many ran at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    async def run(self, item: WorkItem) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(0.01)
        self.now -= 1


async def _drain(s: Scheduler) -> None:
    for _ in range(500):
        if s.in_flight == 0 and s.queue_depth == 0:
            return
        await asyncio.sleep(0.01)


async def test_admission_caps_sandboxes_and_refuses_what_never_fits() -> None:
    counter = PeakCounter()
    s = Scheduler(64, counter.run, Capacity(max_sandboxes=3, cpus=100, memory_mb=10_000))
    s.start()
    s.add_job("a", 1, 64, _items("a", 20), Need(cpus=1, memory_mb=512))
    s.add_job("b", 1, 64, _items("b", 20), Need(cpus=1, memory_mb=512))
    await _drain(s)
    assert counter.peak == 3
    with pytest.raises(CapacityError, match="one sandbox needs 1 CPUs and 20000 MB"):
        s.add_job("c", 1, 1, _items("c", 1), Need(cpus=1, memory_mb=20_000))
    await s.close()


async def test_memory_capacity_bounds_concurrency() -> None:
    counter = PeakCounter()
    s = Scheduler(64, counter.run, Capacity(max_sandboxes=64, cpus=64, memory_mb=2048))
    s.start()
    s.add_job("a", 1, 64, _items("a", 12), Need(cpus=0.5, memory_mb=512))
    await _drain(s)
    await s.close()
    assert counter.peak == 4


async def test_a_job_whose_image_is_building_leaves_the_slots_to_others() -> None:
    started: list[str] = []

    async def run(item: WorkItem) -> None:
        started.append(item.job_id)
        await asyncio.sleep(0.01)

    s = Scheduler(1, run)
    s.start()
    s.add_job("building", 5, 10, _items("building", 3), ready=False)  # higher priority, but no image yet
    s.add_job("built", 1, 10, _items("built", 3))
    for _ in range(500):
        if len(started) == 3 and s.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert started == ["built"] * 3 and s.waiting_for_images == 3
    s.set_ready("building")
    await _drain(s)
    await s.close()
    assert started == ["built"] * 3 + ["building"] * 3 and s.waiting_for_images == 0


class SlowImageEnv(PythonToolEnv):
    """python-tool on an image of its own (which takes the fake backend's build latency to build)."""

    name = "python-tool-slow-image"

    def image_spec(self) -> ImageSpec:
        return ImageSpec(base="envfleet/base:latest", run=["true"])


async def test_live_image_aware_placement_runs_built_images_while_another_builds(
    tmp_path: Path, task_ids: list[str]
) -> None:
    registry = Registry.from_entry_points()
    slow = SlowImageEnv()
    registry.register(slow)
    policy = await start_scripted_server(reference_script(slow, latency_s=0.1))
    backend = FakeBackendConfig(owner=TEST_OWNER, image_build_latency_s=2.0)
    orch = await create_server(
        OrchestratorConfig(port=0, data_dir=tmp_path, max_in_flight=1, backend=backend), registry
    )
    try:
        async with EnvfleetClient(orch.address) as c:
            building = await c.submit(job(policy.url, task_ids[:2]).model_copy(update={"env": slow.name}))
            built = await c.submit(job(policy.url, task_ids[2:4]))
            quick = [r async for r in c.rollouts(built)]
            late = [r async for r in c.rollouts(building)]
        assert [r.reward for r in quick + late] == [1.0] * 4
        # the one slot served the built image while the other image was being built, not the other way round
        assert max(r.timing.queue for r in quick) < min(r.timing.queue for r in late), (quick, late)
        assert min(r.timing.queue for r in late) >= 1.5
        assert {r.provenance.image for r in late} != {r.provenance.image for r in quick}
    finally:
        await orch.stop()
        await policy.close()


async def test_live_admission_queues_jobs_and_refuses_impossible_ones(tmp_path: Path, task_ids: list[str]) -> None:
    env = Registry.from_entry_points().get(ENV)
    policy = await start_scripted_server(reference_script(env, latency_s=0.3))
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path,
            backend=FAKE,
            capacity=Capacity(max_sandboxes=1, cpus=8, memory_mb=8192),
        )
    )
    try:
        async with EnvfleetClient(orch.address) as c:
            a = await c.submit(job(policy.url, task_ids[:2]))
            b = await c.submit(job(policy.url, task_ids[2:3]))
            for _ in range(100):
                if (await c.get_job(a)).in_flight:
                    break
                await asyncio.sleep(0.05)
            assert (await c.get_job(b)).state == "QUEUED", "a job beyond capacity waits, it does not fail"
            assert [r.reward async for r in c.rollouts(a)] == [1.0, 1.0]
            assert [r.reward async for r in c.rollouts(b)] == [1.0]
        small = await create_server(
            OrchestratorConfig(
                port=0,
                data_dir=tmp_path / "small",
                backend=FAKE,
                capacity=Capacity(cpus=0.5, memory_mb=8192),
            )
        )
        try:
            async with EnvfleetClient(small.address) as c:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.submit(job(policy.url, task_ids[:1]))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "lower the environment's limits or raise capacity" in (e.value.details() or "")
        finally:
            await small.stop()
    finally:
        await orch.stop()
        await policy.close()
