"""Fair share is per tenant, then per job: one tenant's many priority-100 jobs cannot starve another tenant, nor can
smaller sandboxes, a name earlier in the alphabet, or a rounding residue."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from orchestrator.core.environment import Task
from orchestrator.rollout.runner import WorkItem
from orchestrator.service import scheduler
from orchestrator.service.scheduler import Capacity, Need, Scheduler


def _items(job_id: str, n: int) -> list[WorkItem]:
    return [WorkItem(job_id, Task(id=f"t{i}", prompt="p"), 0, 0.0) for i in range(n)]


async def test_many_high_priority_jobs_of_one_tenant_do_not_starve_another() -> None:
    owner: dict[str, str] = {}
    running: Counter[str] = Counter()
    samples: list[Counter[str]] = []
    release = asyncio.Event()

    async def run(item: WorkItem) -> None:
        running[owner[item.job_id]] += 1
        samples.append(Counter(running))
        await release.wait()
        running[owner[item.job_id]] -= 1

    s = Scheduler(max_in_flight=8, run=run)
    s.start()
    try:
        for n in range(20):  # the greedy tenant: 20 jobs at the top priority
            owner[f"greedy-{n}"] = "greedy"
            s.add_job(f"greedy-{n}", priority=100, max_concurrency=64, items=_items(f"greedy-{n}", 50), tenant="greedy")
        await asyncio.sleep(0.05)
        owner["modest"] = "modest"
        s.add_job("modest", priority=1, max_concurrency=64, items=_items("modest", 50), tenant="modest")
        for _ in range(3):  # every running rollout ends; the freed slots go by fair share
            release.set()
            await asyncio.sleep(0)
            release.clear()
            await asyncio.sleep(0.05)
        assert s.running_by_tenant() == {"greedy": 4, "modest": 4}, s.running_by_tenant()
    finally:
        release.set()
        await s.close()


async def test_sessions_and_sandboxes_a_tenant_holds_count_in_its_share_of_job_slots() -> None:
    started: Counter[str] = Counter()
    gate = asyncio.Event()

    async def run(item: WorkItem) -> None:
        started[item.job_id] += 1
        await gate.wait()

    s = Scheduler(max_in_flight=8, run=run, capacity=Capacity(max_sandboxes=4, cpus=100, memory_mb=100_000))
    s.start()
    try:
        held = [s.reserve(Need(), "a session", "alice") for _ in range(2)]
        s.add_job("alice-job", priority=1, max_concurrency=64, items=_items("alice-job", 10), tenant="alice")
        s.add_job("bob-job", priority=1, max_concurrency=64, items=_items("bob-job", 10), tenant="bob")
        await asyncio.sleep(0.05)
        assert started == {"bob-job": 2}, started  # alice holds 2 already: the 2 left are bob's
    finally:
        gate.set()
        for r in held:
            r.release()
        await s.close()


async def test_priority_still_weighs_one_tenants_jobs() -> None:
    started: Counter[str] = Counter()
    gate = asyncio.Event()

    async def run(item: WorkItem) -> None:
        started[item.job_id] += 1
        await gate.wait()

    s = Scheduler(max_in_flight=8, run=run)
    s.start()
    try:
        s.add_job("hi", priority=3, max_concurrency=64, items=_items("hi", 50), tenant="t")
        s.add_job("lo", priority=1, max_concurrency=64, items=_items("lo", 50), tenant="t")
        await asyncio.sleep(0.05)
        assert started == {"hi": 6, "lo": 2}
    finally:
        gate.set()
        await s.close()


async def test_a_tenant_of_larger_sandboxes_is_not_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    # each freed CPU went to whichever tenant fitted it at once: beside one of 1-CPU sandboxes, a tenant of 4-CPU
    # sandboxes never ran (140 started to 0). Now the others backfill for DRAIN_AFTER_S, then the host drains for it
    monkeypatch.setattr(scheduler, "DRAIN_AFTER_S", 0.2)
    started: Counter[str] = Counter()

    async def run(item: WorkItem) -> None:
        started[item.job_id] += 1
        await asyncio.sleep(0.01 * (1 + started[item.job_id] % 3))

    s = Scheduler(max_in_flight=64, run=run, capacity=Capacity(max_sandboxes=64, cpus=8, memory_mb=1 << 20))
    s.start()
    try:
        s.add_job(
            "small", priority=1, max_concurrency=64, items=_items("small", 100_000), need=Need(cpus=1), tenant="a"
        )
        await asyncio.sleep(0.05)
        s.add_job(
            "large", priority=1, max_concurrency=64, items=_items("large", 100_000), need=Need(cpus=4), tenant="b"
        )
        await asyncio.sleep(2)
        assert started["large"] >= 5 and started["small"] > started["large"], started
    finally:
        await s.close()


async def test_tied_tenants_take_turns() -> None:
    # one rollout at a time, every tenant at 0 running at each decision: the tie went to the first name, 193 to 0
    started: list[str] = []

    async def run(item: WorkItem) -> None:
        started.append(item.job_id)
        await asyncio.sleep(0)

    s = Scheduler(max_in_flight=1, run=run)
    s.start()
    try:
        s.add_job("alpha", priority=1, max_concurrency=8, items=_items("alpha", 50), tenant="alpha")
        s.add_job("zeta", priority=1, max_concurrency=8, items=_items("zeta", 50), tenant="zeta")
        for _ in range(200):
            await asyncio.sleep(0)
            if len(started) >= 40:
                break
        assert abs(started[:40].count("alpha") - started[:40].count("zeta")) <= 1, started[:40]
    finally:
        await s.close()


def test_fractions_of_a_cpu_leave_no_residue_that_keeps_a_whole_host_rollout_out() -> None:
    # 0.1, 0.2 and 0.4 CPU taken and given back left 1e-16 in use with nothing running: a rollout that needs the
    # whole host was then refused, and a job of them queued for good
    s = Scheduler(max_in_flight=8, run=lambda item: asyncio.sleep(0), capacity=Capacity(cpus=1, memory_mb=1024))
    for _ in range(50):
        held = [s.reserve(Need(cpus=c), "a session") for c in (0.1, 0.2, 0.4, 0.2)]
        for r in reversed(held):
            r.release()
    s.reserve(Need(cpus=1), "a session").release()
