"""Fair share is per tenant, then per job: one tenant's many priority-100 jobs cannot starve another tenant."""

from __future__ import annotations

import asyncio
from collections import Counter

from orchestrator.core.environment import Task
from orchestrator.rollout.runner import WorkItem
from orchestrator.service.scheduler import Scheduler


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
