"""A job's lifecycle calls hold whatever happens to the call: a policy update the job cannot take changes nothing, a
CancelJob or a SubmitJob whose call is cancelled half-way is carried out whole, and submits side by side keep to the
tenant's cap. Real gRPC on the fake backend; the policy is a server that never answers, so jobs stay running."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.backends.fake import FakeBackend
from orchestrator.client.convert import job_spec_to_pb
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import ConfigError
from orchestrator.core.models import JobSpec, JobState, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.server.app import Orchestrator
from orchestrator.testing.qwen_like import QWEN_LIKE_DIR
from orchestrator.testing.synthetic_rollouts import long_rollout
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.conftest import TEST_OWNER
from tests.orchestrator import servers
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import FAKE, expect_error, serve


@pytest.fixture
async def silent_policy() -> AsyncIterator[str]:
    async with servers.silent_policy() as url:
        yield url


GROUPED = {"group_size": 2, "deliver_groups": True}


def _spec(url: str, task_ids: list[str], **policy: Any) -> JobSpec:
    return JobSpec(
        env=ENV,
        tasks=TaskSelection(kind="ids", ids=task_ids),
        policy=PolicyEndpoint(base_url=url, request_timeout_s=600, **policy),
    )


async def _running(client: EnvfleetClient, job_id: str) -> None:
    async with asyncio.timeout(30):
        while (await client.get_job(job_id)).in_flight == 0:  # noqa: ASYNC110 - the job has no event to wait on
            await asyncio.sleep(0.05)


async def test_a_policy_update_the_job_cannot_take_is_refused_and_changes_nothing(
    tmp_path: Path, silent_policy: str, task_ids: list[str]
) -> None:
    # the replay policy is a fine endpoint, but not for a tito job (it samples no tokens): it was kept all the same,
    # and then every read of the job (GetJob, ListJobs, CancelJob) failed, and so did the next start, on every job
    data = tmp_path / "data"
    config: dict[str, Any] = {"backend": FAKE, "tokenizer_dirs": [QWEN_LIKE_DIR.parent]}
    async with serve(data, **config) as orch, EnvfleetClient(orch.address) as client:
        spec = _spec(silent_policy, task_ids[:1], model="qwen-like", tokenizer=QWEN_LIKE_DIR.name)
        job_id = await client.submit(spec)
        update = pb.UpdatePolicyRequest(job_id=job_id, version="2", base_url=REPLAY_URL)
        await expect_error(
            client.rollout_stub.UpdatePolicy(update), grpc.StatusCode.INVALID_ARGUMENT, "tito needs a policy server"
        )
        assert (await client.get_job(job_id)).policy_version == spec.policy.version
        assert orch.jobs._jobs[job_id].spec.policy.base_url == silent_policy
        assert [j.job_id for j in await client.list_jobs()] == [job_id]
    async with serve(data, **config) as again, EnvfleetClient(again.address) as client:
        assert [j.job_id for j in await client.list_jobs()] == [job_id]


async def test_a_removal_cut_short_is_finished_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a job is removed a chunk of rollouts at a time, its row last: one removed before its retention ran out (its
    # tenant's finished jobs over their cap), cut short by a crash, loaded again at the next start with part of its
    # rollouts, after it had answered NOT_FOUND
    from orchestrator.service import store as store_module

    data = tmp_path / "data"
    async with serve(data, backend=FAKE) as orch:
        ids = [t.id for t in orch.jobs.registry.get(ENV).tasks()][:3]
        job_id, _ = await orch.jobs.submit(_spec(REPLAY_URL, ids))
        assert len([e async for batch in orch.jobs.stream(job_id) for e in batch.entries]) == 3
        store = orch.jobs.store
        monkeypatch.setattr(store_module, "REMOVE_CHUNK", 1)
        run, calls = store._run, []

        async def killed(call: Any) -> Any:
            calls.append(call)
            if len(calls) == 3:
                raise RuntimeError("killed")  # the process ends here, a rollout of the job's still in the log
            return await run(call)

        monkeypatch.setattr(store, "_run", killed)
        with pytest.raises(RuntimeError, match="killed"):
            await store.remove_job(job_id)
        monkeypatch.setattr(store, "_run", run)
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        await expect_error(
            client.rollout_stub.GetJob(pb.GetJobRequest(job_id=job_id)), grpc.StatusCode.NOT_FOUND, job_id
        )
    with contextlib.closing(sqlite3.connect(data / "results.sqlite3")) as db:
        assert db.execute("SELECT count(*) FROM rollouts WHERE job_id = ?", (job_id,)).fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM jobs WHERE job_id = ?", (job_id,)).fetchone() == (0,)


async def test_a_job_whose_environment_failed_to_load_at_a_start_waits_for_one_that_loads_it(
    tmp_path: Path, silent_policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a registered environment whose reload failed at a start (a full disk, a plug-in's passing error) was as good as
    # unregistered: its unfinished jobs were cancelled for good, and the next start, which loaded it, had none to run
    from orchestrator.service import registration
    from tests.security.test_tenant_caps import _spec as registered_spec

    data = tmp_path / "data"
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        await client.env_stub.Register(registered_spec("held-env", "1", padding=16))
        job_id = await client.submit(
            JobSpec(env="held-env", tasks=TaskSelection(kind="all"), policy=PolicyEndpoint(base_url=silent_policy))
        )
        await _running(client, job_id)

    def broken(spec: Any) -> Any:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(registration, "make_environment", broken)
        async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
            status = await client.get_job(job_id)
            assert status.state.value == "RUNNING" and status.in_flight == 0
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        await _running(client, job_id)  # resumed

    def refused(spec: Any) -> Any:
        raise ValueError("a check tightened since")

    with monkeypatch.context() as patch:  # a failure that is no passing one: the environment is as good as gone
        patch.setattr(registration, "make_environment", refused)
        async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
            assert (await client.get_job(job_id)).state.value == "CANCELLED"


async def test_policy_updates_side_by_side_or_cut_short_keep_memory_and_log_alike(
    tmp_path: Path, silent_policy: str, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # each began from the endpoint in force and set the job's after the log's write: two side by side both began from
    # the old one and the later undid the other's base_url; one cancelled after the write left memory on the old one
    data = tmp_path / "data"
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(_spec(silent_policy, task_ids[:1]))
        write = orch.jobs.store.update_policy

        async def slow(job: str, new: PolicyEndpoint) -> None:
            await asyncio.sleep(0.2)
            await write(job, new)

        monkeypatch.setattr(orch.jobs.store, "update_policy", slow)
        moved = silent_policy.removesuffix("/v1") + "/v2"  # the same origin
        await asyncio.gather(orch.jobs.update_policy(job_id, "v2", moved), orch.jobs.update_policy(job_id, "v3", ""))
        assert (orch.jobs._jobs[job_id].spec.policy.version, orch.jobs._jobs[job_id].spec.policy.base_url) == (
            "v3",
            moved,
        )
        cut = asyncio.ensure_future(orch.jobs.update_policy(job_id, "v4", ""))
        await asyncio.sleep(0.1)  # its write is under way
        cut.cancel()
        await asyncio.gather(cut, return_exceptions=True)
        await asyncio.sleep(0.3)  # and done
        assert orch.jobs._jobs[job_id].spec.policy.version == "v4"
    async with serve(data, backend=FAKE) as orch:
        assert (orch.jobs._jobs[job_id].spec.policy.version, orch.jobs._jobs[job_id].spec.policy.base_url) == (
            "v4",
            moved,
        )


async def test_a_policy_update_the_log_refused_is_not_in_force_and_its_retry_writes_it(
    tmp_path: Path, silent_policy: str, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the spec changed in memory before the log's write: one the log refused (a lock, a full disk) was in force
    # all the same, the trainer's retry answered OK writing nothing ("nothing to change"), and the next start
    # resumed the job on the old endpoint
    data = tmp_path / "data"
    spec = _spec(silent_policy, task_ids[:3])
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(spec)
        write = orch.jobs.store.update_policy

        async def refused(job: str, new: PolicyEndpoint) -> None:
            raise sqlite3.OperationalError("database is locked")

        monkeypatch.setattr(orch.jobs.store, "update_policy", refused)
        update = pb.UpdatePolicyRequest(job_id=job_id, version="v2")
        with pytest.raises(grpc.aio.AioRpcError):
            await client.rollout_stub.UpdatePolicy(update)
        assert (await client.get_job(job_id)).policy_version == spec.policy.version
        monkeypatch.setattr(orch.jobs.store, "update_policy", write)
        await client.rollout_stub.UpdatePolicy(update)  # the retry
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        assert (await client.get_job(job_id)).policy_version == "v2"


async def test_a_policy_update_that_changes_nothing_writes_nothing_and_one_that_does_keeps_the_tasks(
    tmp_path: Path, silent_policy: str, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # each UpdatePolicy dumped and checked the whole spec (up to 100,000 task ids, megabytes) and wrote it to the
    # result log, whose one thread every tenant's appends, reads and acks share, changed or not. Now one that changes
    # nothing writes nothing, and one that does writes the endpoint alone (a column of its own), which the next
    # start reads over the spec's
    data = tmp_path / "data"
    spec = _spec(silent_policy, task_ids[:3])
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(spec)
        writes: list[PolicyEndpoint] = []
        write = orch.jobs.store.update_policy

        async def counted(job: str, new: PolicyEndpoint) -> None:
            writes.append(new)
            await write(job, new)

        monkeypatch.setattr(orch.jobs.store, "update_policy", counted)
        same = pb.UpdatePolicyRequest(job_id=job_id, version=spec.policy.version)
        for _ in range(5):
            await client.rollout_stub.UpdatePolicy(same)
        assert writes == []
        await client.rollout_stub.UpdatePolicy(pb.UpdatePolicyRequest(job_id=job_id, version="v9"))
        [written] = writes
        assert written.version == "v9" and written.base_url == silent_policy
        kept = orch.jobs._jobs[job_id].spec
        assert kept.policy == written and kept.tasks == spec.tasks
        assert (await client.get_job(job_id)).policy_version == "v9"
    with contextlib.closing(sqlite3.connect(data / "results.sqlite3")) as db:
        stored_spec, policy = db.execute("SELECT spec, policy FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
    submitted = JobSpec.model_validate_json(stored_spec)  # the spec as submitted, not written again
    assert submitted.policy.version == spec.policy.version and submitted.tasks == spec.tasks
    assert len(policy) < 1024 and PolicyEndpoint.model_validate_json(policy) == written
    async with serve(data, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        assert (await client.get_job(job_id)).policy_version == "v9"
        assert orch.jobs._jobs[job_id].spec.policy == written


async def test_a_cancel_whose_call_is_cancelled_is_carried_out_whole(
    tmp_path: Path, silent_policy: str, task_ids: list[str]
) -> None:
    # a CancelJob past its deadline while the running rollouts' sandboxes were torn down stopped half-way: the log
    # said RUNNING, the job's streams were never woken, and the next start ran the job again
    data = tmp_path / "data"
    slow = FakeBackendConfig(owner=TEST_OWNER, destroy_latency_s=2.0)
    async with serve(data, backend=slow) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(_spec(silent_policy, task_ids[:2]))
        await _running(client, job_id)
        stream = asyncio.create_task(_drain(client, job_id))
        await expect_error(
            client.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=0.5),
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        async with asyncio.timeout(20):
            await stream  # woken by the job's end
        assert (await client.get_job(job_id)).state == JobState.CANCELLED
    async with serve(data, backend=FAKE) as again, EnvfleetClient(again.address) as client:
        info = await client.get_job(job_id)
        assert (info.state, info.in_flight) == (JobState.CANCELLED, 0)


async def test_a_cancel_is_in_the_log_before_its_sandboxes_are_torn_down(
    tmp_path: Path, silent_policy: str, task_ids: list[str]
) -> None:
    # CANCELLED reached the log only once every running rollout's sandbox was gone (a removal each, through the
    # engine's rate limit): a stop or a crash in that window left the job RUNNING, and the next start ran it again
    slow = FakeBackendConfig(owner=TEST_OWNER, destroy_latency_s=3.0)
    async with serve(tmp_path / "data", backend=slow) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(_spec(silent_policy, task_ids[:2]))
        await _running(client, job_id)
        await expect_error(
            client.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=0.5),
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        assert orch.jobs._teardowns  # still tearing down
        with contextlib.closing(sqlite3.connect(orch.jobs.store.path)) as db:
            (state,) = db.execute("SELECT state FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        assert state == JobState.CANCELLED.value


async def test_an_open_stream_gets_the_groups_a_cancel_publishes(
    tmp_path: Path, silent_policy: str, task_ids: list[str]
) -> None:
    # a cancel publishes the whole groups whose appends were queued as it came only once the sandboxes are gone, and
    # a stream woken meanwhile (a result, an ack, its pacing) saw the job finished, read nothing, and ended without
    # them: the proto promises an open stream what was logged before the cancel
    slow = FakeBackendConfig(owner=TEST_OWNER, destroy_latency_s=3.0)
    async with serve(tmp_path / "data", backend=slow) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(_spec(silent_policy, task_ids[:1]).model_copy(update=GROUPED))
        await _running(client, job_id)
        for k in range(2):  # a whole group, logged but not published: its last append was in the queue
            member = long_rollout(turns=2, job_id=job_id).model_copy(
                update={"id": f"{job_id}:extra:{k}", "group_id": f"{job_id}:extra", "sample_index": k}
            )
            await orch.jobs.store.append(member, visible=False)
        stream = asyncio.create_task(_groups(client, job_id))
        await asyncio.sleep(0.5)  # the stream is open and waits
        await expect_error(
            client.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=0.5),
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        assert orch.jobs._teardowns  # still tearing down
        orch.jobs._jobs[job_id].notify()  # what a result landing now does
        async with asyncio.timeout(20):
            assert await stream == [f"{job_id}:extra"]


async def test_a_worker_that_does_not_say_when_its_sandboxes_are_gone_is_not_waited_for(
    tmp_path: Path, silent_policy: str, task_ids: list[str]
) -> None:
    # an older worker never sends RolloutResult.cancelled: waited for, each cancel of a rollout there held its slot,
    # and the CancelJob, for the whole wait (past the SDK's call timeout)
    slow = FakeBackendConfig(owner=TEST_OWNER, destroy_latency_s=5.0)
    async with serve(tmp_path / "data", backend=slow, workers=1) as orch, EnvfleetClient(orch.address) as client:
        assert orch.workers is not None
        job_id = await client.submit(_spec(silent_policy, task_ids[:2]))
        async with asyncio.timeout(60):
            while sum(w.running for w in orch.workers.hub.workers()) < 2:  # noqa: ASYNC110 - no event to wait on
                await asyncio.sleep(0.05)
        for w in orch.workers.hub._workers.values():
            w.acks_cancel = False  # as an older worker's hello says
        t0 = time.monotonic()
        await client.cancel_job(job_id)
        assert time.monotonic() - t0 < 2.5 and orch.workers.hub._in_use == 0


async def test_whole_groups_read_behind_a_groups_last_part_go_out_at_once(
    tmp_path: Path, silent_policy: str, task_ids: list[str]
) -> None:
    # a group's last part went out alone, and the whole groups read with it waited, unsent, for the next result or
    # ack to wake the stream: while the job ran on, a trainer that acks once it has its batch waited on groups the
    # control plane held (here for good)
    async with serve(tmp_path / "data", backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(_spec(silent_policy, task_ids[:1]).model_copy(update=GROUPED))
        await _running(client, job_id)
        for group, output in (("big", "x" * 145_000), ("small", "ok")):  # big: 1.6 MB a member
            for k in range(2):
                member = long_rollout(turns=2, job_id=job_id, tool_output=output).model_copy(
                    update={"id": f"{job_id}:{group}:{k}", "group_id": f"{job_id}:{group}", "sample_index": k}
                )
                await orch.jobs.store.append(member, visible=False)
        assert await orch.jobs.store.publish_complete_groups(job_id, 2) == 2
        got: list[str] = []
        async with asyncio.timeout(20):
            async for g in client.groups(job_id, auto_ack=False):  # a trainer that acks once it has a batch
                got.append(g.group_id)
                if len(got) == 2:
                    break
        assert got == [f"{job_id}:big", f"{job_id}:small"]
        await client.cancel_job(job_id)


async def test_a_cancel_stops_the_jobs_rollouts_before_the_log_takes_its_end(
    tmp_path: Path, silent_policy: str, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the cancel's log write came first: while the log refused writes (a full disk), the scheduler kept starting the
    # job's queued rollouts, each a sandbox and a policy call whose result was then thrown away
    async with serve(tmp_path / "data", backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        spec = _spec(silent_policy, task_ids[:8]).model_copy(update={"max_concurrency": 2})
        job_id = await client.submit(spec)
        await _running(client, job_id)
        held = asyncio.Event()

        async def refused(*args: Any, **kwargs: Any) -> None:
            await held.wait()

        monkeypatch.setattr(orch.jobs.store, "set_job_state", refused)
        try:
            await expect_error(
                client.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=0.5),
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
            assert (orch.jobs.scheduler.running_of(job_id), orch.jobs.scheduler.pending_of(job_id)) == (0, 0)
        finally:
            held.set()


async def _groups(client: EnvfleetClient, job_id: str) -> list[str]:
    return [g.group_id async for g in client.groups(job_id)]


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "worker"])
async def test_a_cancel_answers_once_its_sandboxes_are_gone(
    tmp_path: Path, silent_policy: str, task_ids: list[str], workers: int
) -> None:
    # on a worker, the control plane freed a cancelled rollout's slot, and CancelJob answered, as soon as it sent the
    # Cancel: the worker still tore the sandboxes down while it was sent new rollouts (up to twice its slots'
    # sandboxes after a large cancel), and the proto's "destroyed before CancelJob answers" held in-process only
    slow = FakeBackendConfig(owner=TEST_OWNER, destroy_latency_s=2.0)
    async with serve(tmp_path / "data", backend=slow, workers=workers) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(_spec(silent_policy, task_ids[:2]))
        await _running(client, job_id)
        if orch.workers is not None:  # on the worker, not waiting for one to connect
            async with asyncio.timeout(60):
                while sum(w.running for w in orch.workers.hub.workers()) < 2:  # noqa: ASYNC110 - no event to wait on
                    await asyncio.sleep(0.05)
        t0 = time.monotonic()
        info = await client.cancel_job(job_id)
        took = time.monotonic() - t0
        assert info.state == JobState.CANCELLED and took >= 1.5, took
        if orch.workers is not None:
            assert not [a for w in orch.workers.hub._workers.values() for a in w.cancelling], "slots still held"
            assert orch.workers.hub._in_use == 0


async def _drain(client: EnvfleetClient, job_id: str) -> int:
    return len([r async for r in client.rollouts(job_id)])


async def test_a_submit_whose_call_is_cancelled_is_recorded_whole(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the log ran the job's insert although the call was cancelled (a client's deadline in a burst of submits): the
    # job was not in memory, so no one could list, stream or cancel it, and the next start ran it
    store = fake_orchestrator.jobs.store
    create = store.create_job

    async def slow_create(*args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(1.0)
        await create(*args, **kwargs)

    monkeypatch.setattr(store, "create_job", slow_create)
    request = job_spec_to_pb(_spec(REPLAY_URL, task_ids[:2]))
    await expect_error(fake_client.rollout_stub.SubmitJob(request, timeout=0.3), grpc.StatusCode.DEADLINE_EXCEEDED)
    async with asyncio.timeout(20):
        while not (jobs := await fake_client.list_jobs()):  # noqa: ASYNC110 - the manager has no event to wait on
            await asyncio.sleep(0.05)
    (job,) = jobs
    assert [r.task_id async for r in fake_client.rollouts(job.job_id)]  # it runs, and it streams


async def test_submits_side_by_side_keep_to_the_tenants_cap(
    tmp_path: Path, silent_policy: str, task_ids: list[str]
) -> None:
    # each read the same count of unfinished jobs before any was recorded: all ten were taken with a cap of two
    async with (
        serve(tmp_path / "data", backend=FAKE, caps={"jobs_per_tenant": 2}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        spec = job_spec_to_pb(_spec(silent_policy, task_ids[:1]))
        calls = [client.rollout_stub.SubmitJob(spec) for _ in range(10)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    refused = [e for e in outcomes if isinstance(e, grpc.aio.AioRpcError)]
    assert len(outcomes) - len(refused) == 2, outcomes
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}


async def test_submits_whose_callers_give_up_while_recording_keep_to_the_tenants_cap(
    tmp_path: Path, silent_policy: str, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a cancelled submit's job is recorded all the same, but its admission was let go at the cancel: the next
    # submit's check missed the job being recorded, and submits with a short deadline stacked jobs past the cap
    async with (
        serve(tmp_path / "data", backend=FAKE, caps={"jobs_per_tenant": 2}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        create_job = orch.jobs.store.create_job

        async def slow(*args: Any, **kwargs: Any) -> None:
            await asyncio.sleep(1.0)
            await create_job(*args, **kwargs)

        monkeypatch.setattr(orch.jobs.store, "create_job", slow)
        spec = job_spec_to_pb(_spec(silent_policy, task_ids[:1]))
        for _ in range(6):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.rollout_stub.SubmitJob(spec, timeout=0.2)
            assert e.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
        await asyncio.sleep(1.5)  # the records under way end
        assert len(await client.list_jobs()) == 2


@pytest.mark.parametrize("groups", [False, True], ids=["rollouts", "groups"])
async def test_a_job_cancelled_while_its_results_wait_for_the_log_counts_and_streams_them(
    tmp_path: Path, groups: bool
) -> None:
    # the log runs a queued append to its end when its caller is cancelled: a CancelJob landing then left rows the
    # job never counted (GetJob said done 0, acked 4), and, delivered in groups, whole groups never published
    import time

    from orchestrator.core.models import Rollout, RolloutStatus
    from orchestrator.service.jobs import JobManager
    from orchestrator.service.registry import Registry
    from orchestrator.service.store import ResultStore

    gate = asyncio.Event()

    class Gated:
        images = FakeBackend(FAKE).images

        async def run(self, item: Any, env: Any, spec: JobSpec) -> Rollout:
            await gate.wait()
            return Rollout(
                id=item.id,
                job_id=item.job_id,
                env=env.ref(),
                task_id=item.task.id,
                group_id=item.group_id,
                sample_index=item.sample_index,
                status=RolloutStatus.OK,
                reward=float(item.sample_index),
            )

        def job_ended(self, job_id: str) -> None:
            pass

        async def close(self) -> None:
            pass

    store = await ResultStore.open(tmp_path / "log.sqlite3")
    registry = Registry.from_entry_points()
    mgr = await JobManager.start(store, registry, Gated())  # type: ignore[arg-type]
    try:
        ids = [t.id for t in registry.get(ENV).tasks()][:2]
        spec = JobSpec(
            env=ENV,
            tasks=TaskSelection(kind="ids", ids=ids),
            group_size=2,
            deliver_groups=groups,
            policy=PolicyEndpoint(base_url=REPLAY_URL),
        )
        job_id, total = await mgr.submit(spec)
        await asyncio.sleep(0.5)  # its rollouts run, held at the gate
        transaction = store._transaction

        def slow(calls: Any) -> Any:
            time.sleep(0.3)  # a busy disk: the appends wait in the log's queue
            return transaction(calls)

        store._transaction = slow  # type: ignore[method-assign]
        gate.set()
        await asyncio.sleep(0.05)
        info = await mgr.cancel(job_id)
        store._transaction = transaction  # type: ignore[method-assign]
        logged, _ = await store.counts(job_id)
        assert info.state == JobState.CANCELLED and sum(logged.values()) == total
        assert info.counts.done == total and info.counts.by_status == {"OK": total}
        streamed = [b async for b in mgr.stream(job_id)]
        got = [e for b in streamed for e in b.entries] + [e for b in streamed for g in b.groups for e in g.entries]
        assert len(got) == total
        assert all(len(g.entries) == 2 for b in streamed for g in b.groups)
    finally:
        await mgr.close()
        await store.close()


async def test_a_quiet_stream_that_its_client_pings_as_often_as_allowed_stays_open(
    tmp_path: Path, silent_policy: str, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the SDK pings a quiet connection every 30 s, and the server meant to allow one every 10 s; the option it set had
    # the wrong name, so gRPC's default held (one every 5 minutes, two strikes): a trainer's stream that waited on slow
    # rollouts for a minute and a half was cut with GOAWAY "too_many_pings", and after a reconnect failed for good.
    # Here the server allows a ping every 0.5 s and the client pings every 0.6 s
    import orchestrator.server.app as app

    monkeypatch.setattr(app, "CLIENT_PING_MIN_MS", 500)
    pinging = [
        ("grpc.keepalive_time_ms", 600),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_time_between_pings_ms", 600),
    ]
    async with (
        serve(tmp_path, backend=FAKE) as orch,
        EnvfleetClient(orch.address) as client,
        grpc.aio.insecure_channel(orch.address, options=pinging) as channel,
    ):
        job_id = await client.submit(_spec(silent_policy, task_ids[:1]))
        await _running(client, job_id)
        stream = pb_grpc.RolloutServiceStub(channel).StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))
        read = asyncio.ensure_future(stream.read())
        await asyncio.sleep(6)  # ten pings; the third too soon was the cut
        assert not read.done(), read.exception() if read.done() else None
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await read


async def test_a_quiet_stream_rides_out_restarts_further_apart_than_its_reconnect_window(
    tmp_path: Path, silent_policy: str, task_ids: list[str]
) -> None:
    # an outage's spell ended only with the stream's next message: a quiet stream (slow rollouts) that reconnected
    # through one restart and stayed up for minutes counted a second restart as the same outage, past reconnect_s,
    # and the trainer's iterator raised UNAVAILABLE
    from orchestrator.server.app import OrchestratorConfig, create_server

    config = OrchestratorConfig(port=0, data_dir=tmp_path / "data", backend=FAKE)
    orch = await create_server(config)
    config = config.model_copy(update={"port": orch.port})
    try:
        async with EnvfleetClient(orch.address, reconnect_s=2) as client:
            job_id = await client.submit(_spec(silent_policy, task_ids[:1]))
            messages = client.rollout_messages(job_id)
            reader = asyncio.ensure_future(anext(messages))
            for _ in range(2):
                await asyncio.sleep(4.5)  # up, and quiet, for longer than reconnect_s (after a reconnect's backoff)
                assert not reader.done(), reader.exception()
                await orch.stop(grace=0)
                await asyncio.sleep(0.5)
                orch = await create_server(config)
            await asyncio.sleep(1.5)
            assert not reader.done(), reader.exception()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            await messages.aclose()
    finally:
        await orch.stop(grace=1)


async def test_a_stop_stage_that_fails_leaves_the_later_ones_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stage that raised (the sweep of lost workers' sandboxes on an engine answering 500) ended the stop there:
    # the warm pool, the backend's close that removes this instance's containers, the store's close never ran
    async with serve(tmp_path, backend=FAKE) as orch:
        backend, store = orch.backend, orch.store
        closed: list[str] = []
        close_backend, close_store = backend.close, store.close

        async def failing() -> None:
            raise RuntimeError("the engine answered 500")

        async def backend_close() -> None:
            closed.append("backend")
            await close_backend()

        async def store_close() -> None:
            closed.append("store")
            await close_store()

        monkeypatch.setattr(orch.jobs, "close", failing)
        monkeypatch.setattr(backend, "close", backend_close)
        monkeypatch.setattr(store, "close", store_close)
    assert closed == ["store", "backend"]  # the log (and the data directory) first: the removal waits on the engine


async def test_a_server_whose_metrics_cannot_start_stops_what_had_started(tmp_path: Path) -> None:
    # the metrics server starts after the start's undo stack is spent: a metrics host this machine lacks raised out
    # of create_server with the gRPC server (and the workers, the pool, the store) left running behind the error
    import socket

    from orchestrator.server.app import OrchestratorConfig, create_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = OrchestratorConfig(
        port=port,
        data_dir=tmp_path,
        backend=FAKE,
        metrics_port=0,
        metrics_host="192.0.2.1",  # TEST-NET: not ours
    )
    with pytest.raises(ConfigError, match=r"cannot serve metrics on 192\.0\.2\.1:0 \(--metrics-port\)"):
        await create_server(config)
    with pytest.raises(OSError):  # nothing listens on the gRPC port any more
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()


def test_only_a_passing_failure_holds_a_job() -> None:
    import errno

    from orchestrator.service.registration import _passing

    assert _passing(OSError(errno.ENOSPC, "No space left on device"))
    assert not _passing(FileNotFoundError(errno.ENOENT, "an archive deleted by hand"))
    assert not _passing(ValueError("a check tightened since"))
    try:
        try:
            raise OSError(errno.EIO, "I/O error")
        except OSError:
            raise RuntimeError("the plug-in's load failed") from None  # the context Python does not show
    except RuntimeError as hidden:
        assert not _passing(hidden)
    try:
        try:
            raise OSError(errno.EIO, "I/O error")
        except OSError as e:
            raise RuntimeError("the plug-in's load failed") from e
    except RuntimeError as caused:
        assert _passing(caused)
