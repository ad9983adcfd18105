"""When a new job's rollouts start: once no submit has been in progress for START_QUIET_S, so that a burst of submits
is answered before the work it brings; at the latest START_DEFER_S after the job was accepted; never for a job
cancelled meanwhile. Real gRPC, jobs, store and scheduler on the fake backend."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, JobState, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.server.app import Orchestrator
from orchestrator.service import jobs as jobs_module
from tests.orchestrator.conftest import ENV


def _job(task_id: str) -> JobSpec:
    return JobSpec(env=ENV, tasks=TaskSelection(kind="ids", ids=[task_id]), policy=PolicyEndpoint(base_url=REPLAY_URL))


def _started(orch: Orchestrator, job_id: str) -> bool:
    return bool(orch.jobs.scheduler.pending_of(job_id) or orch.jobs.scheduler.running_of(job_id))


def _hold_the_job_insert(orch: Orchestrator, task_id: str) -> tuple[asyncio.Event, asyncio.Event]:
    """The submit of a job on `task_id` stays in progress (its record not yet written) until `release` is set;
    `entered` is set once it is held there."""
    entered, release = asyncio.Event(), asyncio.Event()
    create = orch.store.create_job

    async def held(job_id: str, spec: JobSpec, total: int, owner: str = "local") -> None:
        if spec.tasks.ids == [task_id]:
            entered.set()
            await release.wait()
        await create(job_id, spec, total, owner)

    orch.store.create_job = held  # type: ignore[method-assign]
    return entered, release


async def _statuses(client: EnvfleetClient, job_id: str) -> list[str]:
    async with asyncio.timeout(60):
        return [r.status.value async for r in client.rollouts(job_id)]


async def test_rollouts_start_once_the_submits_beside_them_are_answered(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_module, "START_DEFER_S", 600.0)  # only the end of the submits starts them here
    orch = fake_orchestrator
    entered, release = _hold_the_job_insert(orch, task_ids[0])
    slow: asyncio.Task[Any] = asyncio.ensure_future(fake_client.submit(_job(task_ids[0])))
    await entered.wait()  # the slow submit is in progress
    first = await fake_client.submit(_job(task_ids[1]))
    cancelled = await fake_client.submit(_job(task_ids[2]))
    # answered, recorded, and not started: the scheduler has none of their rollouts yet
    for job_id in (first, cancelled):
        assert not _started(orch, job_id)
        assert (await fake_client.get_job(job_id)).state == JobState.QUEUED
    assert (await fake_client.cancel_job(cancelled)).state == JobState.CANCELLED
    release.set()
    last = await slow
    assert await _statuses(fake_client, first) == ["OK"]
    assert await _statuses(fake_client, last) == ["OK"]
    # the job cancelled before its start ran nothing, and never will
    assert await _statuses(fake_client, cancelled) == []
    status = await fake_client.get_job(cancelled)
    assert status.state == JobState.CANCELLED and status.done == 0
    assert orch.jobs.scheduler.pending_of(cancelled) == 0 and orch.jobs.scheduler.running_of(cancelled) == 0


async def test_rollouts_start_after_the_deferral_even_while_submits_keep_coming(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_module, "START_DEFER_S", 0.05)
    orch = fake_orchestrator
    entered, release = _hold_the_job_insert(orch, task_ids[0])
    slow: asyncio.Task[Any] = asyncio.ensure_future(fake_client.submit(_job(task_ids[0])))
    try:
        await entered.wait()
        # a submit stays in progress throughout: the deferral's bound alone starts this job
        assert await _statuses(fake_client, await fake_client.submit(_job(task_ids[1]))) == ["OK"]
        assert orch.jobs._submitting == 1
    finally:
        release.set()
        await slow


async def test_a_submit_in_the_quiet_spell_after_another_holds_both_jobs_back(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Submits one after another, each answered before the next arrives (as in a burst from one client when the
    server keeps up): no job starts until the last submit has been answered for START_QUIET_S (the code before
    started each job as soon as its own submit was answered)."""
    monkeypatch.setattr(jobs_module, "START_DEFER_S", 600.0)
    monkeypatch.setattr(jobs_module, "START_QUIET_S", 2.0)
    orch = fake_orchestrator
    submitted = []
    for task_id in task_ids[:4]:
        submitted.append(await fake_client.submit(_job(task_id)))
        await asyncio.sleep(0.05)
        for job_id in submitted:
            assert not _started(orch, job_id) and (await fake_client.get_job(job_id)).state == JobState.QUEUED
    assert [await _statuses(fake_client, job_id) for job_id in submitted] == [["OK"]] * 4
