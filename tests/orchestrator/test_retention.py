"""A finished job is kept `job_retention_s` after its end, then removed from memory and from the result log, unless a
stream of it is still open; a restart removes what ran out while it was down. A job's counts are kept in memory as
its rollouts are logged and acked, equal to the log's, so that GetJob and ListJobs read no log. Real gRPC, jobs,
store and scheduler on the fake backend."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from orchestrator.cli.main import _server_config, build_parser
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import DEFAULT_JOB_RETENTION_S, JobSpec, JobState, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.server.app import Orchestrator, OrchestratorConfig
from orchestrator.service import jobs as jobs_module
from protos import orchestrator_pb2 as pb
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import FAKE, expect_error, serve


def _job(ids: list[str]) -> JobSpec:
    return JobSpec(env=ENV, tasks=TaskSelection(kind="ids", ids=ids), policy=PolicyEndpoint(base_url=REPLAY_URL))


def _rows(data: Path, job_id: str) -> tuple[int, int]:
    """The job's rows in the result log on disk: (jobs, rollouts)."""
    with sqlite3.connect(data / "results.sqlite3") as db:
        (jobs,) = db.execute("SELECT COUNT(*) FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        (rollouts,) = db.execute("SELECT COUNT(*) FROM rollouts WHERE job_id = ?", (job_id,)).fetchone()
    return jobs, rollouts


async def _run(client: EnvfleetClient, ids: list[str]) -> str:
    """A job run to its end, every rollout consumed and acked."""
    job_id = await client.submit(_job(ids))
    async with asyncio.timeout(60):
        assert len([r async for r in client.rollouts(job_id)]) == len(ids)
    return job_id


async def _gone(client: EnvfleetClient, data: Path, job_id: str, timeout_s: float = 30) -> str:
    """Wait until GetJob says NOT_FOUND (the job left memory first), then until the log holds none of its rows;
    GetJob's message."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                await client.get_job(job_id)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND, e
                message = e.details() or ""
                break
            await asyncio.sleep(0.05)
        while True:  # the log's rows go right after
            if _rows(data, job_id) == (0, 0):
                return message
            await asyncio.sleep(0.05)


async def test_a_finished_job_is_removed_from_memory_and_the_log_after_its_retention(
    tmp_path: Path, task_ids: list[str]
) -> None:
    data = tmp_path / "data"
    async with serve(data, backend=FAKE, job_retention_s=0.5) as orch, EnvfleetClient(orch.address) as client:
        sample = orch.jobs.metrics.registry.get_sample_value
        job_id = await _run(client, task_ids[:3])
        assert (await client.get_job(job_id)).state == JobState.COMPLETED
        assert _rows(data, job_id) == (1, 3)
        assert sample("envfleet_jobs", {"state": "COMPLETED"}) == 1 and sample("envfleet_jobs_removed_total") == 0
        assert (sample("envfleet_result_log_bytes") or 0) > 0
        message = await _gone(client, data, job_id)
        assert f"no job '{job_id}'" in message and "kept 0.5s after its end" in message
        assert sample("envfleet_jobs", {"state": "COMPLETED"}) == 0 and sample("envfleet_jobs_removed_total") == 1
        assert job_id not in {j.job_id for j in await client.list_jobs()}
        await expect_error(
            client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id)), grpc.StatusCode.NOT_FOUND
        )
        # the log still takes and serves new jobs after a removal
        assert (await client.get_job(await _run(client, task_ids[3:5]))).done == 2


async def test_a_job_with_an_open_stream_is_kept_until_the_stream_ends(tmp_path: Path, task_ids: list[str]) -> None:
    data = tmp_path / "data"
    async with serve(data, backend=FAKE, job_retention_s=0.3) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(_job(task_ids[:3]))
        # a window of one, never acked: the stream stays open on the finished job, with two rollouts unsent
        call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=1))
        first = await call.read()
        assert len(first.rollouts) == 1
        async with asyncio.timeout(30):
            while True:
                if (await client.get_job(job_id)).state == JobState.COMPLETED:
                    break
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # three retentions
        assert await orch.jobs.expire() == 0
        assert (await client.get_job(job_id)).done == 3 and _rows(data, job_id) == (1, 3)
        call.cancel()
        await _gone(client, data, job_id)


async def test_a_wall_clock_set_on_neither_removes_a_finished_job_early_nor_reorders_the_cap(
    tmp_path: Path, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # retention ran on the wall clock: an NTP step of an hour (a clock kept in local time, a VM resumed) removed every
    # finished job at the next expiry round, its rollouts unacked (a trainer between reconnects lost them); and the
    # finished-jobs cap, sorting by the wall clock, took the newest as the oldest after a step back
    data = tmp_path / "data"
    caps = {"finished_jobs_per_tenant": 2}
    async with serve(data, backend=FAKE, job_retention_s=3600, caps=caps) as orch, EnvfleetClient(orch.address) as c:
        first, second = await _run(c, task_ids[:1]), await _run(c, task_ids[1:2])
        # the job manager's clocks (gRPC's deadlines read the wall clock too)
        monkeypatch.setattr(
            jobs_module, "time", SimpleNamespace(time=lambda: time.time() + 7200, monotonic=time.monotonic)
        )
        assert await orch.jobs.expire() == 0
        assert (await c.get_job(first)).state == JobState.COMPLETED
        monkeypatch.setattr(
            jobs_module, "time", SimpleNamespace(time=lambda: time.time() - 7200, monotonic=time.monotonic)
        )
        third = await _run(c, task_ids[2:3])  # past the cap: the oldest, `first`, goes
        await expect_error(c.get_job(first), grpc.StatusCode.NOT_FOUND)
        fourth = await _run(c, task_ids[3:4])  # then `second`, which ended before `third` whatever the wall clock says
        await expect_error(c.get_job(second), grpc.StatusCode.NOT_FOUND)
        assert {(await c.get_job(j)).state for j in (third, fourth)} == {JobState.COMPLETED}


async def test_a_restart_removes_the_jobs_whose_retention_ran_out_while_it_was_down(
    tmp_path: Path, task_ids: list[str]
) -> None:
    data = tmp_path / "data"
    async with serve(data, backend=FAKE, job_retention_s=None) as orch, EnvfleetClient(orch.address) as client:
        old = await _run(client, task_ids[:2])
        await asyncio.sleep(0.6)
        assert await orch.jobs.expire() == 0  # no retention: kept for good
        assert (await client.get_job(old)).state == JobState.COMPLETED
    async with serve(data, backend=FAKE, job_retention_s=0.5) as orch, EnvfleetClient(orch.address) as client:
        # removed before the server answered anything: the expiry's first round has not come yet
        await expect_error(client.get_job(old), grpc.StatusCode.NOT_FOUND, f"no job '{old}'")
        assert _rows(data, old) == (0, 0)


async def test_a_removal_cut_short_is_finished_at_the_next_start(tmp_path: Path, task_ids: list[str]) -> None:
    data = tmp_path / "data"
    async with serve(data, backend=FAKE, job_retention_s=None) as orch, EnvfleetClient(orch.address) as client:
        job_id = await _run(client, task_ids[:3])
    # what a crash between two of the removal's chunks leaves: the job's row and some of its rollouts
    with sqlite3.connect(data / "results.sqlite3") as db:
        db.execute("DELETE FROM rollouts WHERE seq = (SELECT MIN(seq) FROM rollouts WHERE job_id = ?)", (job_id,))
        db.execute("UPDATE jobs SET finished_at = finished_at - 10 WHERE job_id = ?", (job_id,))
    assert _rows(data, job_id) == (1, 2)
    async with serve(data, backend=FAKE, job_retention_s=5.0) as orch, EnvfleetClient(orch.address) as client:
        await expect_error(client.get_job(job_id), grpc.StatusCode.NOT_FOUND, "kept 5s after its end")
        assert _rows(data, job_id) == (0, 0)


async def test_a_removal_of_more_rollouts_than_a_chunk_deletes_them_all(
    tmp_path: Path, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.service import store as store_module

    monkeypatch.setattr(store_module, "REMOVE_CHUNK", 2)
    data = tmp_path / "data"
    async with serve(data, backend=FAKE, job_retention_s=0.2) as orch, EnvfleetClient(orch.address) as client:
        job_id = await _run(client, task_ids[:5])
        await _gone(client, data, job_id)


async def test_counts_are_kept_in_memory_equal_to_the_log(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, task_ids: list[str]
) -> None:
    orch, client = fake_orchestrator, fake_client
    job_id = await client.submit(_job(task_ids[:4]))
    got: list[pb.Rollout] = []
    call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_batch=1))
    async for batch in call:
        got.extend(batch.rollouts)
        if len(got) == 4:
            break
    call.cancel()
    await client.ack(job_id, ids=[got[1].id, got[3].id])
    await client.ack(job_id, ids=[got[1].id])  # acked already: counted once
    by_status, acked = await orch.store.counts(job_id)
    info = await client.get_job(job_id)
    assert acked == 2 and by_status == {"OK": 4}
    assert (info.acked, info.done, {k.value: v for k, v in info.by_status.items()}) == (acked, 4, by_status)

    async def no_log(job_id: str) -> tuple[dict[str, int], int]:
        raise AssertionError("GetJob and ListJobs read the counts from memory")

    orch.store.counts = no_log  # type: ignore[method-assign]
    (listed,) = [j for j in await client.list_jobs() if j.job_id == job_id]
    assert (listed.acked, listed.done) == (2, 4)


def test_serve_keeps_finished_jobs_a_day_and_minus_one_keeps_them_for_good() -> None:
    parse = build_parser().parse_args
    assert OrchestratorConfig().job_retention_s == DEFAULT_JOB_RETENTION_S == 86_400
    config = _server_config(parse(["serve"]))
    assert isinstance(config, OrchestratorConfig) and config.job_retention_s == DEFAULT_JOB_RETENTION_S
    config = _server_config(parse(["serve", "--job-retention-s", "-1"]))
    assert isinstance(config, OrchestratorConfig) and config.job_retention_s is None
    config = _server_config(parse(["serve", "--job-retention-s", "3600"]))
    assert isinstance(config, OrchestratorConfig) and config.job_retention_s == 3600


async def test_a_restart_reads_every_jobs_counts_back_from_the_log(tmp_path: Path, task_ids: list[str]) -> None:
    data = tmp_path / "data"
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        done = await _run(client, task_ids[:2])  # every rollout acked
        job_id = await client.submit(_job(task_ids[:4]))
        call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))
        got: list[pb.Rollout] = []
        async for batch in call:
            got.extend(batch.rollouts)
            if len(got) == 4:
                break
        call.cancel()
        await client.ack(job_id, ids=[got[0].id])
        before = {j: await client.get_job(j) for j in (done, job_id)}
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        for j, info in before.items():
            after = await client.get_job(j)
            assert (after.done, after.acked, after.by_status) == (info.done, info.acked, info.by_status)
        assert (before[done].acked, before[job_id].acked) == (2, 1)
        # everything logged before the restart counts as delivered: an ack up to the last seq is taken
        assert await client.ack(job_id, up_to=max(r.seq for r in got)) == 3
        assert (await client.get_job(job_id)).acked == 4
