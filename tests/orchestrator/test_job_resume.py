"""A restart resumes the unfinished jobs of the result log; one that can no longer run (its environment or a task of
it gone while the server was down) is ended as CANCELLED, with what it logged still streamed and acked, and the
server starts. Real gRPC, jobs, store and scheduler on the fake backend; the log is edited as an upgrade would leave
it."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, JobState, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import FAKE, serve, until_done


@pytest.mark.parametrize("gone", ["environment", "task"])
async def test_a_job_that_can_no_longer_run_is_cancelled_at_the_restart_and_keeps_what_it_logged(
    tmp_path: Path, task_ids: list[str], gone: str
) -> None:
    data = tmp_path / "data"
    spec = JobSpec(
        env=ENV, tasks=TaskSelection(kind="ids", ids=task_ids[:3]), policy=PolicyEndpoint(base_url=REPLAY_URL)
    )
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(spec)
        assert await until_done(client, job_id, 3, timeout_s=60) == 3
    # what a stop mid-job leaves (one rollout not logged yet), after an upgrade dropped the job's environment or a
    # task it names
    with sqlite3.connect(data / "results.sqlite3") as db:
        (stored,) = db.execute("SELECT spec FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        changed = json.loads(stored)
        if gone == "environment":
            changed["env"] = "retired-env@1"
        else:
            changed["tasks"]["ids"] = [*task_ids[:2], "retired-task"]
        db.execute(
            "UPDATE jobs SET spec = ?, state = 'RUNNING', finished_at = NULL WHERE job_id = ?",
            (json.dumps(changed), job_id),
        )
        db.execute("DELETE FROM rollouts WHERE seq = (SELECT MAX(seq) FROM rollouts WHERE job_id = ?)", (job_id,))
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        info = await client.get_job(job_id)
        assert info.state == JobState.CANCELLED and info.done == 2
        async with asyncio.timeout(30):
            assert len([r async for r in client.rollouts(job_id)]) == 2  # streamed, acked, the stream ends
        assert (await client.get_job(job_id)).acked == 2
        assert len(await client.list_jobs()) == 1


async def test_a_job_row_this_version_cannot_read_is_left_alone_and_the_server_starts(
    tmp_path: Path, task_ids: list[str]
) -> None:
    # one row of the log whose spec no longer validates (a validator tightened by an upgrade, a damaged row) made
    # the store's read of the jobs raise, and the server did not start; the other jobs resume
    data = tmp_path / "data"
    spec = JobSpec(
        env=ENV, tasks=TaskSelection(kind="ids", ids=task_ids[:2]), policy=PolicyEndpoint(base_url=REPLAY_URL)
    )
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        bad, good = await client.submit(spec), await client.submit(spec)
        for job_id in (bad, good):
            assert await until_done(client, job_id, 2, timeout_s=60) == 2
    with sqlite3.connect(data / "results.sqlite3") as db:
        (stored,) = db.execute("SELECT spec FROM jobs WHERE job_id = ?", (bad,)).fetchone()
        db.execute(
            "UPDATE jobs SET spec = ? WHERE job_id = ?", (json.dumps({**json.loads(stored), "group_size": 0}), bad)
        )
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        assert [j.job_id for j in await client.list_jobs()] == [good]
    with sqlite3.connect(data / "results.sqlite3") as db:  # and the row is still there, for a version that reads it
        assert db.execute("SELECT COUNT(*) FROM jobs WHERE job_id = ?", (bad,)).fetchone() == (1,)
    # until its retention runs out, as any finished job's: never loaded, it was never expired, and stayed for good
    async with serve(data, backend=FAKE, job_retention_s=0.2) as orch:
        for _ in range(100):
            with sqlite3.connect(data / "results.sqlite3") as db:
                left = db.execute("SELECT COUNT(*) FROM rollouts WHERE job_id = ?", (bad,)).fetchone()
                left += db.execute("SELECT COUNT(*) FROM jobs WHERE job_id = ?", (bad,)).fetchone()
            if left == (0, 0):
                break
            await asyncio.sleep(0.1)
        assert left == (0, 0), left


async def test_a_cancel_cut_before_its_groups_were_published_publishes_them_at_the_restart(
    tmp_path: Path, task_ids: list[str]
) -> None:
    # the cancel is logged first, and a stop or a crash can come before it publishes the job's whole groups: they
    # stayed unpublished for good (the start skipped finished jobs), and a trainer never got them
    data = tmp_path / "data"
    spec = JobSpec(
        env=ENV,
        tasks=TaskSelection(kind="ids", ids=task_ids[:2]),
        policy=PolicyEndpoint(base_url=REPLAY_URL),
        group_size=2,
        deliver_groups=True,
    )
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(spec)
        assert await until_done(client, job_id, 4, timeout_s=60) == 4
    with sqlite3.connect(data / "results.sqlite3") as db:
        db.execute("UPDATE jobs SET state = 'CANCELLED' WHERE job_id = ?", (job_id,))
        db.execute("UPDATE rollouts SET visible = 0 WHERE job_id = ?", (job_id,))
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        assert (await client.get_job(job_id)).state == JobState.CANCELLED
        async with asyncio.timeout(30):
            groups = [g async for g in client.groups(job_id)]
        assert sorted(len(g.rollouts) for g in groups) == [2, 2]
