"""A tenant's results in the result log are bounded (caps.result_bytes_per_tenant): a tenant whose policy answers
16 MiB turns, or whose trainer never reads, filled the log's disk, and every tenant's results then waited for room.
Past the cap the tenant's oldest finished jobs whose rollouts are all acked and that no stream reads go early, as
many as bring it under (results not acked yet stay: delivery is at least once); where they cannot, a job that logs a
rollout is cancelled (its streams end RESOURCE_EXHAUSTED, saying why, once all it logged is sent) and its SubmitJob
is refused. Real gRPC, jobs, store and scheduler on the fake backend."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from pathlib import Path

import grpc

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobState
from orchestrator.core.policy import REPLAY_URL
from orchestrator.server.app import Orchestrator
from orchestrator.testing.synthetic_rollouts import long_rollout
from protos import orchestrator_pb2 as pb
from tests.orchestrator.servers import FAKE, expect_error, serve, silent_policy

TOKEN_A, TOKEN_B = (secrets.token_urlsafe(24) for _ in range(2))
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _job(group_size: int = 2, max_concurrency: int = 0) -> pb.JobSpec:
    return pb.JobSpec(
        env="python-tool",
        tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["py-000"]),
        group_size=group_size,
        max_concurrency=max_concurrency,
        policy=pb.PolicyEndpoint(base_url=REPLAY_URL),
    )


async def _run(client: EnvfleetClient) -> str:
    """A job of two rollouts run to its end, both consumed and acked."""
    job_id = str((await client.rollout_stub.SubmitJob(_job())).job_id)
    async with asyncio.timeout(60):
        assert len([r async for r in client.rollouts(job_id)]) == 2
    return job_id


def _logged(data: Path, job_id: str) -> int:
    with sqlite3.connect(data / "results.sqlite3") as db:
        return int(db.execute("SELECT COUNT(*) FROM rollouts WHERE job_id = ?", (job_id,)).fetchone()[0])


async def _gone(client: EnvfleetClient, data: Path, job_id: str) -> None:
    """GetJob says NOT_FOUND, and the log holds none of the job's rows (they go in the background)."""
    await expect_error(client.get_job(job_id), grpc.StatusCode.NOT_FOUND)
    async with asyncio.timeout(30):
        while True:
            if not _logged(data, job_id):
                break
            await asyncio.sleep(0.05)


def _cap(orch: Orchestrator, cap: int) -> None:
    """What `caps: {result_bytes_per_tenant: cap}` sets, set on a running server (the job sizes are measured)."""
    orch.jobs.caps = orch.jobs.caps.model_copy(update={"result_bytes_per_tenant": cap})


async def test_the_oldest_finished_jobs_go_first_and_a_restart_counts_what_the_log_holds(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with serve(data, backend=FAKE, job_retention_s=None) as orch, EnvfleetClient(orch.address) as c:
        first, second = await _run(c), await _run(c)
        held = [await orch.store.stored_bytes(j) for j in (first, second)]
        assert orch.jobs._stored["local"] == sum(held) > 0  # what the appends counted is what the log holds
        _cap(orch, sum(held) + held[0] // 2)  # room for one more rollout, not for a third job's two
        third = await _run(c)  # its second rollout took the tenant over: `first` went, the others stay
        await _gone(c, data, first)
        assert {(await c.get_job(j)).state for j in (second, third)} == {JobState.COMPLETED}
        assert orch.jobs._stored["local"] == sum([await orch.store.stored_bytes(j) for j in (second, third)])
        cap = orch.jobs.caps.result_bytes_per_tenant
    # counted from the log at the start: counted from nothing, the fourth job's rollouts took no one over
    async with (
        serve(data, backend=FAKE, job_retention_s=None, caps={"result_bytes_per_tenant": cap}) as orch,
        EnvfleetClient(orch.address) as c,
    ):
        fourth = await _run(c)
        await _gone(c, data, second)
        assert {(await c.get_job(j)).state for j in (third, fourth)} == {JobState.COMPLETED}


async def test_a_tenant_whose_unfinished_jobs_hold_more_is_cancelled_told_why_and_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"tokens:\n  {TOKEN_A}: team-a\n  {TOKEN_B}: team-b\n")
    tokens.chmod(0o600)
    security = {"token_file": tokens, "replay_reference": "all"}
    async with (
        serve(data, backend=FAKE, security=security) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        one = await _run(b)  # what a rollout of this task holds (team-b's, apart from team-a's)
        cap = await orch.store.stored_bytes(one) * 5 // 4  # room for two rollouts and a half
        _cap(orch, cap)
        job_id = str((await a.rollout_stub.SubmitJob(_job(group_size=32, max_concurrency=1))).job_id)
        # a stream that takes one rollout and acks none: open while more is logged, it keeps the job from going
        held = a.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=1))
        first = await held.read()
        assert isinstance(first, pb.RolloutBatch) and len(first.rollouts) == 1
        async with asyncio.timeout(30):
            while True:
                info = await a.get_job(job_id)
                if info.state == JobState.CANCELLED and info.finished_at:
                    break
                await asyncio.sleep(0.05)
        # its third rollout took it over: cancelled, what it logged kept
        assert 3 <= info.done < 32 and _logged(data, job_id) == info.done
        # its results are over the cap and nothing of its may go: refused, naming the cap
        await expect_error(a.rollout_stub.SubmitJob(_job()), EXHAUSTED, f"caps.result_bytes_per_tenant = {cap}")
        assert await _run(b)  # the cap is per tenant: team-b runs on (its first job makes room)
        held.cancel()

        # a stream gets all the job logged, then why it ended
        got: list[pb.Rollout] = []
        call = a.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))
        details = ""
        try:
            async for batch in call:
                got.extend(batch.rollouts)
        except grpc.aio.AioRpcError as e:
            assert e.code() == EXHAUSTED, e
            details = e.details() or ""
        assert len(got) == info.done, details
        assert f"job {job_id} was cancelled" in details and f"caps.result_bytes_per_tenant = {cap}" in details

        # sent, not acked: kept (a trainer that reads its jobs one at a time lost the unread ones), so still refused
        await expect_error(a.rollout_stub.SubmitJob(_job()), EXHAUSTED, "ack the rollouts of finished jobs")
        assert (await a.get_job(job_id)).state == JobState.CANCELLED
        # acked, and no stream reads it: the next submit makes room with it, and is taken
        await a.ack(job_id, up_to=max(r.seq for r in got))
        again = await a.rollout_stub.SubmitJob(_job(group_size=1))
        await _gone(a, data, job_id)
        assert again.job_id


async def test_a_grouped_job_cancelled_mid_group_goes_once_all_it_sent_is_acked(tmp_path: Path) -> None:
    # a group it never completed is never sent, nor acked: counted among what is to be acked, the job could never go
    # early, and its tenant stayed refused until its retention ran out (for good, kept for good)
    data = tmp_path / "data"
    async with silent_policy() as url, serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as c:
        spec = _job(group_size=4)
        spec.deliver_groups = True
        spec.policy.base_url = url
        job_id = str((await c.rollout_stub.SubmitJob(spec)).job_id)
        # one sample of its group logged, the others still running (the policy never answers)
        member = long_rollout(turns=2, job_id=job_id).model_copy(
            update={"id": f"{job_id}:py-000:0", "group_id": f"{job_id}:py-000", "sample_index": 0}
        )
        await orch.jobs.store.append(member, visible=False)
        info = await c.cancel_job(job_id)
        assert info.state == JobState.CANCELLED and info.done == 1
        assert not [r async for r in c.rollouts(job_id)]  # its group is not whole: never sent
        _cap(orch, 1024)
        spec.deliver_groups = False
        again = await c.rollout_stub.SubmitJob(spec)  # the cancelled job makes room, and goes
        await _gone(c, data, job_id)
        assert again.job_id


async def test_an_ack_that_slims_its_rows_gives_their_bytes_back(tmp_path: Path) -> None:
    # with acked rows slimmed (--result-log-acked slim), a trainer that keeps up holds little: counted at their size
    # when logged for good, its jobs went early and were cancelled for bytes the log no longer held
    async with (
        serve(tmp_path / "data", backend=FAKE, result_log_acked="slim") as orch,
        EnvfleetClient(orch.address) as c,
    ):
        job_id = str((await c.rollout_stub.SubmitJob(_job())).job_id)
        async with asyncio.timeout(60):
            rollouts = [r async for r in c.rollouts(job_id, auto_ack=False)]
        whole = orch.jobs._stored["local"]
        assert len(rollouts) == 2 and whole == await orch.store.stored_bytes(job_id)
        await c.ack(job_id, ids=[r.id for r in rollouts])
        slim = await orch.store.stored_bytes(job_id)
        assert orch.jobs._stored["local"] == slim < whole / 2
