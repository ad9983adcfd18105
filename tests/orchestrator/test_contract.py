"""The trainer contract as protos/orchestrator.proto states it, checked over real gRPC: seq and Ack, backpressure
and the end of a stream, defaults of 0, enums and times on the wire, CancelJob, CloseSession and its alias."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from orchestrator.client.convert import TOKEN_STATUS_PB
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobState, RolloutStatus
from orchestrator.testing.scripted_policy import ScriptedServer
from protos import orchestrator_pb2 as pb
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import expect_error, serve


async def _until_completed(client: EnvfleetClient, job_id: str) -> None:
    for _ in range(1200):
        if (await client.get_job(job_id)).state == JobState.COMPLETED:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} did not complete")


async def _read_all(call: object, within_s: float = 30.0) -> list[pb.RolloutBatch]:
    """Every message of a stream that must end by itself."""
    async with asyncio.timeout(within_s):
        return [b async for b in call]  # type: ignore[attr-defined]


async def test_ack_beyond_what_was_delivered_is_refused(
    client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    job_id = await client.submit(job(policy_server.url, task_ids[:3]))
    await _until_completed(client, job_id)
    await expect_error(
        client.rollout_stub.Ack(pb.AckRequest(job_id=job_id, up_to=1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "nothing delivered after seq 0",
    )
    # max_in_flight=1 keeps the server from sending ahead (it writes as far as the window lets, read or not)
    call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=1))
    first = (await call.read()).rollouts[0]
    call.cancel()
    # the next rollouts of the job are logged but were never sent: acking them would lose them
    await expect_error(
        client.rollout_stub.Ack(pb.AckRequest(job_id=job_id, up_to=first.seq + 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"nothing delivered after seq {first.seq}",
    )
    assert (await client.get_job(job_id)).acked == 0, "a refused Ack must ack nothing"
    assert await client.ack(job_id, up_to=first.seq) == 1
    assert await client.ack(job_id, up_to=first.seq) == 0, "acking is idempotent"
    rest = [r async for r in client.rollouts(job_id, resume_after=first.seq)]
    assert sorted([first.id, *(r.id for r in rest)]) == sorted(f"{job_id}:{t}:0" for t in task_ids[:3])


async def test_ack_by_id_acks_only_what_was_delivered_and_a_group_whole(
    client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # ids are easily guessed (job:task:sample): acked before they were sent, rollouts were never sent at all; and
    # in group delivery one member acked alone left the rest of its group to go out as a group of two
    job_id = await client.submit(job(policy_server.url, task_ids[:3]))
    await _until_completed(client, job_id)
    guessed = [f"{job_id}:{t}:0" for t in task_ids[:2]]
    assert (await client.rollout_stub.Ack(pb.AckRequest(job_id=job_id, ids=guessed))).acked == 0
    sent = [b async for b in client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))]
    assert sorted(r.id for b in sent for r in b.rollouts) == sorted(f"{job_id}:{t}:0" for t in task_ids[:3])
    assert (await client.rollout_stub.Ack(pb.AckRequest(job_id=job_id, ids=guessed))).acked == 2  # sent by now

    grouped = await client.submit(job(policy_server.url, task_ids[:2], n=3, deliver_groups=True))
    await _until_completed(client, grouped)
    call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=grouped, max_in_flight=1))
    group = (await call.read()).groups[0]
    call.cancel()
    acked = await client.rollout_stub.Ack(pb.AckRequest(job_id=grouped, ids=[group.rollouts[0].id]))
    assert acked.acked == 3  # the group, whole
    again = [b async for b in client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=grouped))]
    sizes = [len(g.rollouts) for b in again for g in b.groups]
    assert sizes == [3] and again[0].groups[0].group_id != group.group_id, sizes


async def test_ack_after_a_restart_accepts_what_was_logged_before(
    tmp_path: Path, base_image: str, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    async with serve(tmp_path / "data") as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(job(policy_server.url, task_ids[:2]))
        await _until_completed(client, job_id)
        seqs = [
            r.seq
            for b in await _read_all(
                client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=2))
            )
            for r in b.rollouts
        ]
    # the trainer got both, the server went away before the ack: the restarted one takes the ack
    async with serve(tmp_path / "data") as orch, EnvfleetClient(orch.address) as client:
        assert await client.ack(job_id, up_to=max(seqs)) == 2
        await expect_error(
            client.rollout_stub.Ack(pb.AckRequest(job_id=job_id, up_to=max(seqs) + 1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"nothing delivered after seq {max(seqs)}",
        )


async def test_groups_count_rollouts_in_flight_arrive_in_seq_order_and_the_stream_ends(
    client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    job_id = await client.submit(job(policy_server.url, task_ids[:2], n=2, deliver_groups=True))
    await _until_completed(client, job_id)
    # max_in_flight counts rollouts: 1 allows one message, and a group of 2 is never split
    call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=1))
    first = await call.read()
    assert [len(g.rollouts) for g in first.groups] == [2] and not first.rollouts
    pending = asyncio.ensure_future(call.read())
    await asyncio.sleep(1.0)
    assert not pending.done(), "the stream sent past max_in_flight"
    # ack a group: up_to is the seq of its last rollout
    assert await client.ack(job_id, up_to=first.groups[0].rollouts[-1].seq) == 2
    second = await asyncio.wait_for(pending, 30)
    assert [len(g.rollouts) for g in second.groups] == [2]
    # the job is finished and everything was sent: the stream ends although the window is full (nothing acked)
    async with asyncio.timeout(30):
        assert await call.read() is grpc.aio.EOF
    seqs = [r.seq for b in (first, second) for g in b.groups for r in g.rollouts]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4


async def test_a_full_window_does_not_keep_a_finished_stream_open(
    client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    job_id = await client.submit(job(policy_server.url, task_ids[:3]))
    await _until_completed(client, job_id)
    req = pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=3, max_batch=1)
    batches = await _read_all(client.rollout_stub.StreamRollouts(req))
    seqs = [r.seq for b in batches for r in b.rollouts]
    assert len(seqs) == 3 and seqs == sorted(seqs)


async def test_enums_times_and_the_resolved_env_on_the_wire(
    client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    before = time.time()
    job_id = await client.submit(job(policy_server.url, task_ids[:2]))  # env "python-tool", no version
    await _until_completed(client, job_id)
    batches = await _read_all(client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id)))
    rollouts = [r for b in batches for r in b.rollouts]
    assert len(rollouts) == 2
    for r in rollouts:
        assert r.status == pb.ROLLOUT_STATUS_OK and r.env == f"{ENV}@1"
        assert r.tokens.status != pb.TOKEN_STATUS_UNSPECIFIED
        assert r.tokens.status == TOKEN_STATUS_PB[r.tokens.status_name]  # the deprecated text agrees
        assert before <= r.started_at <= r.finished_at <= time.time()
        assert r.finished_at - r.started_at >= r.timing.total - 1e-3

    status = await client.rollout_stub.GetJob(pb.GetJobRequest(job_id=job_id))
    assert (status.state, status.state_name) == (pb.JOB_STATE_COMPLETED, "COMPLETED")
    assert status.env == f"{ENV}@1"
    assert dict(status.by_status) == {"OK": 2}
    assert status.created_at <= status.finished_at <= time.time()
    # the average since submit, frozen once the job is finished
    assert abs(status.rollouts_per_s - 2 / (status.finished_at - status.created_at)) < 1e-6
    await asyncio.sleep(0.3)
    later = await client.rollout_stub.GetJob(pb.GetJobRequest(job_id=job_id))
    assert later.rollouts_per_s == status.rollouts_per_s

    # the Python SDK maps the enums back to the models' names
    info = await client.get_job(job_id)
    assert info.state is JobState.COMPLETED and info.by_status == {RolloutStatus.OK: 2}
    got = [r async for r in client.rollouts(job_id)]  # nothing acked yet: both come again
    assert {r.status for r in got} == {RolloutStatus.OK}
    wire = {r.id: r for r in rollouts}
    assert all(r.tokens.status == wire[r.id].tokens.status_name for r in got)
    assert all(0 < r.started_at <= r.finished_at for r in got)


async def test_zero_takes_the_default_and_errors_say_so(
    client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    spec = pb.JobSpec(env=ENV, group_size=-1, policy=pb.PolicyEndpoint(base_url=policy_server.url))
    await expect_error(
        client.rollout_stub.SubmitJob(spec), grpc.StatusCode.INVALID_ARGUMENT, "group_size", "0 means the default, 1"
    )
    await expect_error(
        client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id="j", max_in_flight=100_001)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_in_flight must be between 1 and 100000 (0 means 256)",
    )
    spec = pb.JobSpec(
        env=ENV,
        tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=task_ids[:6]),
        group_size=0,
        max_concurrency=0,
        policy=pb.PolicyEndpoint(base_url=policy_server.url),
    )
    reply = await client.rollout_stub.SubmitJob(spec)
    assert reply.num_rollouts == 6  # group_size 0 means 1

    # CancelJob: answers CANCELLED once stopped; open streams end; nothing is logged afterwards
    call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=reply.job_id))
    cancelled = await client.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=reply.job_id))
    assert cancelled.state == pb.JOB_STATE_CANCELLED and cancelled.finished_at > 0
    sent = [r for b in await _read_all(call) for r in b.rollouts]
    await asyncio.sleep(0.5)
    after = await client.rollout_stub.GetJob(pb.GetJobRequest(job_id=reply.job_id))
    assert after.done == cancelled.done and after.state == pb.JOB_STATE_CANCELLED
    assert len(sent) == after.done <= 6


async def test_close_session_and_its_deprecated_alias(client: EnvfleetClient) -> None:
    stub = client.session_stub
    a = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
    b = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
    assert (await stub.CloseSession(pb.CloseSessionRequest(session_id=a.session_id))).was_running
    assert (await stub.Close(pb.CloseSessionRequest(session_id=b.session_id))).was_running
    for sid in (a.session_id, b.session_id):
        await expect_error(
            stub.Step(pb.StepRequest(session_id=sid, action=pb.Action(final_answer="1"))),
            grpc.StatusCode.NOT_FOUND,
            "was closed",
        )
