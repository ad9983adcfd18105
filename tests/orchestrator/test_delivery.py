"""Delivery that loses nothing: disconnect and resume and backpressure (on the fake backend), and an orchestrator
SIGKILLed mid-job and restarted on real Docker (its sandboxes swept; a fake-backend twin is in test_backend_choice)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest

from orchestrator.client import sdk
from orchestrator.client.convert import rollout_from_pb
from orchestrator.client.sdk import EnvfleetClient, SyncEnvfleetClient
from orchestrator.core.models import RolloutStatus
from orchestrator.core.policy import REPLAY_URL
from orchestrator.server.app import Orchestrator
from orchestrator.service.advantages import group_advantages
from orchestrator.service.jobs import _grouped_message, _within_bytes
from orchestrator.service.registry import Registry
from orchestrator.service.store import LogEntry, ResultStore
from orchestrator.testing.policy_script import Script, Step
from orchestrator.testing.scripted_policy import ScriptedServer, start_scripted_server
from orchestrator.testing.scripts import reference_script
from orchestrator.testing.synthetic_rollouts import long_rollout
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.conftest import REPO, TEST_OWNER
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, expect_error, serve, until_done


async def test_disconnect_and_resume_loses_nothing(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    client = fake_client
    job_id = await client.submit(job(policy_server.url, task_ids[:8], max_concurrency=4))
    # first connection: take 5 rollouts, ack only the first 3, then drop the stream
    first: list[pb.Rollout] = []
    call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_batch=1))
    async for batch in call:
        first.extend(batch.rollouts)
        if len(first) >= 5:
            break
    call.cancel()
    await client.ack(job_id, up_to=first[2].seq)
    # reconnect after the acked seq: the 2 unacked ones come again, then the rest; nothing is lost
    second = [r async for r in client.rollouts(job_id, resume_after=first[2].seq)]
    ids_second = [r.id for r in second]
    assert len(set(ids_second)) == len(ids_second)
    assert {r.id for r in first[3:5]} <= set(ids_second), "unacked rollouts must be delivered again"
    assert not {r.id for r in first[:3]} & set(ids_second), "acked rollouts must not come back"
    assert {r.id for r in first[:3]} | set(ids_second) == {f"{job_id}:{t}:0" for t in task_ids[:8]}
    info = await client.get_job(job_id)
    assert info.acked == 8
    # a cursor past what the job sent (another job's seq, or made up) is refused: it skipped every unacked
    # rollout up to it, and the stream ended as if the job were done
    beyond = client.rollout_stub.StreamRollouts(
        pb.StreamRolloutsRequest(job_id=job_id, resume_after=max(*(r.seq for r in first), *(r.seq for r in second)) + 1)
    )
    await expect_error(beyond, grpc.StatusCode.INVALID_ARGUMENT, "no rollout of job", "resume after the last seq")


async def test_backpressure_holds_at_max_in_flight(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    client = fake_client
    job_id = await client.submit(job(policy_server.url, task_ids[:6], max_concurrency=6))
    for _ in range(600):
        if (await client.get_job(job_id)).state == "COMPLETED":
            break
        await asyncio.sleep(0.1)
    got: list[pb.Rollout] = []
    call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=2, max_batch=10))
    batch = await call.read()
    got.extend(batch.rollouts)
    assert len(got) == 2
    pending = asyncio.create_task(call.read())
    await asyncio.sleep(0.5)
    assert not pending.done(), "the stream sent past max_in_flight"  # nothing more until something is acked
    await client.ack(job_id, ids=[got[0].id])
    batch = await asyncio.wait_for(pending, 5)
    assert len(batch.rollouts) == 1
    call.cancel()


async def test_a_client_remembers_the_acks_of_its_last_jobs_only(
    fake_client: EnvfleetClient, monkeypatch: pytest.MonkeyPatch, task_ids: list[str]
) -> None:
    """A trainer that holds one client for weeks and runs a job a step: its client kept every job's ack."""
    monkeypatch.setattr(sdk, "MAX_ACKED_JOBS", 2)
    jobs = [await fake_client.submit(job(REPLAY_URL, task_ids[:1])) for _ in range(3)]
    for job_id in jobs:
        rollouts = [r async for r in fake_client.rollouts(job_id, auto_ack=False)]
        await fake_client.ack(job_id, up_to=rollouts[-1].seq)
    assert list(fake_client._acked) == jobs[1:]


async def test_rows_acked_while_a_stream_reads_them_hold_no_room_in_its_window(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # a stream that resumes behind an ack in flight reads rows the ack takes while it reads: counted as sent after
    # the ack, they held its window for good, and the rest of the job never went out
    client = fake_client
    job_id = await client.submit(job(policy_server.url, task_ids[:4], max_concurrency=4))
    assert await until_done(client, job_id, 4, timeout_s=60) == 4
    first = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=2, max_batch=2))
    sent = list((await first.read()).rollouts)
    first.cancel()
    assert len(sent) == 2
    store = fake_orchestrator.jobs.store
    read, held, go = store.read, asyncio.Event(), asyncio.Event()

    async def slow(*args: Any, **kwargs: Any) -> list[LogEntry]:
        entries = await read(*args, **kwargs)
        held.set()
        await go.wait()
        return entries

    store.read = slow  # type: ignore[method-assign]
    again = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=2, max_batch=2))
    pending = asyncio.ensure_future(again.read())
    await asyncio.wait_for(held.wait(), 10)
    store.read = read  # type: ignore[method-assign]
    await client.ack(job_id, up_to=sent[-1].seq)  # the rows the resumed stream has just read
    go.set()
    got = [r.id for r in (await asyncio.wait_for(pending, 10)).rollouts]
    assert got == [r.id for r in sent]  # at least once: sent again
    rest = await asyncio.wait_for(again.read(), 10)  # and its window is free for the rest
    assert len(rest.rollouts) == 2
    again.cancel()


async def _start(data: Path, owner: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0", "--data-dir", str(data), "--owner", owner],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
    assert line.startswith("listening "), line
    return proc, line.split()[1]


async def test_sigkill_mid_job_then_restart_completes_without_loss(
    tmp_path: Path, base_image: str, registry: Registry, task_ids: list[str], docker_client: docker.DockerClient
) -> None:
    server = await start_scripted_server(reference_script(registry.get(ENV), latency_s=0.4))
    owner = f"{TEST_OWNER}-kill"
    data = tmp_path / "data"
    ids = task_ids[:10]
    procs: list[subprocess.Popen[str]] = []
    try:
        proc, address = await _start(data, owner)
        procs.append(proc)
        async with EnvfleetClient(address) as c:
            job_id = await c.submit(job(server.url, ids, max_concurrency=3))
            done_before = await until_done(c, job_id, 3, timeout_s=60)
        assert 3 <= done_before < len(ids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # the low-level list: containers the dead owner was removing may vanish between a list and an inspect
        # (its workers' reapers may be removing them already: the restart's sweep removes what they have not)
        left = docker_client.api.containers(all=True, filters={"label": [f"envfleet.owner={owner}"]})

        proc, address = await _start(data, owner)
        procs.append(proc)
        async with EnvfleetClient(address) as c:
            rollouts = [r async for r in c.rollouts(job_id)]
            info = await c.get_job(job_id)
        assert info.state == "COMPLETED" and info.done == len(ids)
        assert sorted(r.task_id for r in rollouts) == sorted(ids)
        assert all(r.reward == 1.0 for r in rollouts)
        # the dead orchestrator's sandboxes are gone, swept at restart or by their reapers
        survivors = {c["Id"] for c in docker_client.api.containers(all=True)} & {c["Id"] for c in left}
        assert not survivors, "containers of the killed orchestrator survived the restart"
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)
        await server.close()
    # rollouts done before the kill were not redone: exactly one row per rollout id
    store = await ResultStore.open(data / "results.sqlite3")
    try:
        assert len(await store.done_ids(job_id)) == len(ids)
    finally:
        await store.close()
    assert docker_client.api.containers(all=True, filters={"label": [f"envfleet.owner={owner}"]}) == []


async def test_stream_of_unknown_job_is_not_found(fake_client: EnvfleetClient) -> None:
    call = fake_client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id="nope"))
    try:
        await call.read()
        raise AssertionError("expected NOT_FOUND")
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND and "no job 'nope'" in (e.details() or "")


async def test_a_result_log_that_refuses_writes_for_a_while_loses_no_rollout(
    tmp_path: Path, policy_server: ScriptedServer, task_ids: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    # another process holds the log's write lock past SQLite's busy timeout (5 s): the writes of the job's start
    # and of its rollouts fail. A failed write killed the rollout's task, and the rollout was lost, its job left
    # RUNNING for good; now each write is tried again until the log takes it
    import sqlite3

    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.server.app import OrchestratorConfig, create_server

    data = tmp_path / "data"
    orch = await create_server(OrchestratorConfig(port=0, data_dir=data, backend=FakeBackendConfig(owner=TEST_OWNER)))
    try:
        async with EnvfleetClient(orch.address) as client:
            job_id = await client.submit(job(policy_server.url, task_ids[:4]))  # recorded; its rollouts start soon
            lock = sqlite3.connect(data / "results.sqlite3", isolation_level=None)
            lock.execute("BEGIN EXCLUSIVE")
            for _ in range(200):  # until writes have failed
                if "database is locked" in caplog.text:
                    break
                await asyncio.sleep(0.1)
            lock.execute("ROLLBACK")
            lock.close()
            assert "database is locked" in caplog.text
            async with asyncio.timeout(60):  # a rollout lost: the job never ends, nor its stream
                got = [r async for r in client.rollouts(job_id)]
            assert sorted(r.task_id for r in got) == sorted(task_ids[:4])
            assert {r.status for r in got} == {"OK"}
            assert (await client.get_job(job_id)).state == "COMPLETED"
    finally:
        await orch.stop(grace=1)


async def test_groups_of_a_job_not_delivered_in_groups_is_a_clear_error(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # it read only the batches' groups: nothing was acked, and the stream stopped at max_in_flight for good
    job_id = await fake_client.submit(job(policy_server.url, task_ids[:4]))
    with pytest.raises(ValueError, match="deliver_groups=True"):
        async with asyncio.timeout(60):
            async for _ in fake_client.groups(job_id, max_in_flight=2):
                pass


async def test_an_auto_ack_waits_out_a_server_restart(
    tmp_path: Path, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # the stream reconnects through a restart; the auto-ack of the batch just consumed did not, and the iterator
    # raised UNAVAILABLE, leaving its caller to start again from 0 and take every rollout twice
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.server.app import OrchestratorConfig, create_server

    config = OrchestratorConfig(port=0, data_dir=tmp_path / "data", backend=FakeBackendConfig(owner=TEST_OWNER))
    orch = await create_server(config)
    config = config.model_copy(update={"port": orch.port})
    async with EnvfleetClient(orch.address, reconnect_s=60) as client:
        job_id = await client.submit(job(policy_server.url, task_ids[:4]))
        for _ in range(600):
            if (await client.get_job(job_id)).state == "COMPLETED":
                break
            await asyncio.sleep(0.1)
        rollouts = client.rollouts(job_id, max_batch=1)
        first = await anext(rollouts)
        await orch.stop(grace=0)

        async def restart() -> None:
            nonlocal orch
            await asyncio.sleep(1.5)
            orch = await create_server(config)

        again = asyncio.create_task(restart())
        try:
            rest = [r async for r in rollouts]  # the first's ack is made once the server is back
        finally:
            await again
            await orch.stop(grace=1)
    assert sorted([first.id, *(r.id for r in rest)]) == sorted(f"{job_id}:{t}:0" for t in task_ids[:4])


async def test_results_that_land_within_the_gap_go_out_in_one_batch(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # one at a time, six results land a few ms apart: each alone made a log read, a message and an ack
    from orchestrator.service import jobs

    monkeypatch.setattr(jobs, "STREAM_GAP_S", 2.0)
    job_id = await fake_client.submit(job(policy_server.url, task_ids[:6], max_concurrency=1))
    call = fake_client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_batch=64))
    sizes = [len(batch.rollouts) async for batch in call]
    assert sum(sizes) == 6
    # the first goes out at once; the rest landed within the gap after it, so they go together
    assert sizes == [1, 5], sizes


async def test_a_full_window_is_not_held_back_by_the_gap(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # with max_in_flight 2 each ack frees the room the next batch needs: neither the stream's gap nor the SDK's may
    # stand between them (8 rollouts would take 4 gaps of 30 s)
    from orchestrator.client import sdk
    from orchestrator.service import jobs

    monkeypatch.setattr(jobs, "STREAM_GAP_S", 30.0)
    monkeypatch.setattr(sdk, "ACK_GAP_S", 30.0)
    job_id = await _finished_job(fake_client, policy_server, task_ids[:8])
    call = fake_client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=2))
    first = await call.read()
    assert len(first.rollouts) == 2
    await fake_client.ack(job_id, up_to=first.rollouts[1].seq)
    async with asyncio.timeout(10):  # the ack woke a stream waiting for room: it sends at once
        assert len((await call.read()).rollouts) == 2
    call.cancel()
    async with asyncio.timeout(20):
        got = [r.id async for r in fake_client.rollouts(job_id, max_in_flight=2, max_batch=1)]
    assert len(set(got)) == 6  # the two sent but not acked come again
    assert (await fake_client.get_job(job_id)).acked == 8


async def _finished_job(client: EnvfleetClient, policy_server: ScriptedServer, ids: list[str]) -> str:
    """A job of these tasks, run to its end."""
    job_id = await client.submit(job(policy_server.url, ids, max_concurrency=len(ids)))
    assert await until_done(client, job_id, len(ids), timeout_s=60) == len(ids)
    return job_id


async def _full_window(client: EnvfleetClient, job_id: str) -> Any:
    """A stream of the job with a window of 2, filled: its first batch read, nothing acked."""
    call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_in_flight=2))
    assert len((await call.read()).rollouts) == 2
    return call


async def test_an_ack_that_lands_while_a_full_window_reads_the_log_is_not_lost(
    fake_orchestrator: Orchestrator,
    fake_client: EnvfleetClient,
    policy_server: ScriptedServer,
    task_ids: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a finished job's stream with a full window reads the log once more (is anything left?) before it waits for
    # room: an ack landing during that read found the window not yet marked full and woke nobody, so the stream
    # waited for an ack that had come, forever (seen once in CI as a 20 s timeout of the test above)
    job_id = await _finished_job(fake_client, policy_server, task_ids[:4])
    store = fake_orchestrator.jobs.store
    read = store.read
    acked = asyncio.Event()

    async def read_then_ack(job: str, after: int, limit: int, *args: Any, **kw: Any) -> list[LogEntry]:
        entries = await read(job, after, limit, *args, **kw)
        if limit == 1 and after == 2 and not acked.is_set():  # the check a full window makes before it waits
            acked.set()
            await fake_orchestrator.jobs.ack(job, 2, [])
        return entries

    monkeypatch.setattr(store, "read", read_then_ack)
    call = await _full_window(fake_client, job_id)
    async with asyncio.timeout(10):
        assert len((await call.read()).rollouts) == 2  # the ack made room: the rest comes at once
    assert acked.is_set()
    call.cancel()


async def test_an_ack_whose_call_is_cancelled_still_frees_the_window(
    fake_orchestrator: Orchestrator,
    fake_client: EnvfleetClient,
    policy_server: ScriptedServer,
    task_ids: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the store runs a queued call even when its caller is cancelled (an Ack RPC past its deadline): the rows were
    # acked in the log, but the streams never heard of it, a later ack acked nothing new, and the full window hung
    job_id = await _finished_job(fake_client, policy_server, task_ids[:4])
    jobs = fake_orchestrator.jobs
    call = await _full_window(fake_client, job_id)
    gate, entered = threading.Event(), threading.Event()
    transaction = jobs.store._transaction

    def held(calls: list[Any]) -> list[tuple[bool, Any]]:
        entered.set()
        gate.wait(10)  # the ack's transaction runs while its caller is cancelled
        return transaction(calls)

    monkeypatch.setattr(jobs.store, "_transaction", held)
    acking = asyncio.create_task(jobs.ack(job_id, 2, []))
    assert await asyncio.to_thread(entered.wait, 10)
    acking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await acking
    monkeypatch.setattr(jobs.store, "_transaction", transaction)
    gate.set()
    async with asyncio.timeout(10):
        assert len((await call.read()).rollouts) == 2  # the window was freed all the same
    assert (await fake_client.get_job(job_id)).acked == 2
    call.cancel()


async def test_auto_acks_go_behind_the_reader_and_are_through_when_it_stops(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrator.client import sdk

    monkeypatch.setattr(sdk, "ACK_GAP_S", 30.0)
    sent: list[int] = []
    ack = fake_client.ack

    async def counted(job_id: str, up_to: int = 0, ids: object = ()) -> int:
        sent.append(up_to)
        return await ack(job_id, up_to=up_to)

    monkeypatch.setattr(fake_client, "ack", counted)
    job_id = await _finished_job(fake_client, policy_server, task_ids[:8])
    # the reader stops after its fifth rollout: the four batches before it were consumed, the fifth was not
    async with asyncio.timeout(20), contextlib.aclosing(fake_client.rollouts(job_id, max_batch=1)) as rollouts:
        seen = 0
        async for _ in rollouts:
            seen += 1
            if seen == 5:
                break
    # the first ack went at once, the next three waited for the gap together and were sent when the reader stopped
    assert len(sent) == 2 and sent[0] < sent[1], sent
    assert (await fake_client.get_job(job_id)).acked == 4
    # read to the end: the rest is acked by the time the iterator ends, in one more ack
    async with asyncio.timeout(20):
        rest = [r.id async for r in fake_client.rollouts(job_id, max_batch=1)]
    assert len(rest) == 4 and len(sent) == 4, sent  # a new reader's first ack goes at once, the others together
    assert (await fake_client.get_job(job_id)).acked == 8


async def test_a_rollout_the_log_cannot_encode_is_delivered_masked_and_its_job_ends(
    fake_orchestrator: Orchestrator,
    fake_client: EnvfleetClient,
    policy_server: ScriptedServer,
    task_ids: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a rollout holding what the log cannot encode (a lone surrogate: pydantic's ValueError) was never logged, and
    # its job waited for it for ever
    store = fake_orchestrator.jobs.store
    append = store.append_sized
    unstorable = f":{task_ids[0]}:"

    async def refusing(rollout: Any, *, visible: bool = True) -> tuple[int, int] | None:
        if unstorable in rollout.id and rollout.status == RolloutStatus.OK:
            raise ValueError("surrogates not allowed")
        return await append(rollout, visible=visible)

    monkeypatch.setattr(store, "append_sized", refusing)
    job_id = await _finished_job(fake_client, policy_server, task_ids[:2])
    got = {r.task_id: r async for r in fake_client.rollouts(job_id)}
    masked, fine = got[task_ids[0]], got[task_ids[1]]
    assert masked.status == RolloutStatus.INFRA_ERROR and masked.reward is None
    assert masked.error is not None and "could not be stored: surrogates not allowed" in masked.error.message
    assert fine.status == RolloutStatus.OK
    # the metric counts each as the log holds it: the OK that could not be stored was counted OK before
    rollouts = fake_orchestrator.jobs.metrics.rollouts
    assert (rollouts.labels("OK")._value.get(), rollouts.labels("INFRA_ERROR")._value.get()) == (1, 1)


async def test_a_reader_that_stops_early_ends_its_stream_on_the_server(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # the call was left open when the reader broke out: the server's stream went on for good, holding one of the
    # tenant's streams (64), so a trainer that read a few rollouts a step was refused at about its 65th step
    job_id = await _finished_job(fake_client, policy_server, task_ids[:4])
    for _ in range(3):
        async with contextlib.aclosing(fake_client.rollouts(job_id, max_in_flight=2, max_batch=1)) as rollouts:
            async for _ in rollouts:
                break
    listeners = fake_orchestrator.jobs._jobs[job_id].listeners
    async with asyncio.timeout(10):
        while listeners:  # noqa: ASYNC110 - the job's listeners have no event to wait on
            await asyncio.sleep(0.05)


async def test_a_closed_sync_client_and_its_iterators_close_again_without_waiting(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # close() stopped the client's loop and left it there: a second close, an iterator closed after it (its
    # finally), any call, each waited for ever on a loop that would never run it
    job_id = await _finished_job(fake_client, policy_server, task_ids[:4])

    def run() -> None:
        c = SyncEnvfleetClient(fake_orchestrator.address)
        it = c.rollouts(job_id, max_batch=1)
        next(it)
        c.close()
        c.close()
        it.close()
        with pytest.raises(RuntimeError, match="closed"):
            c.get_job(job_id)

    await asyncio.wait_for(asyncio.to_thread(run), 20)
    assert (await fake_client.get_job(job_id)).acked == 0  # the one it read was not consumed: it comes again


async def test_the_sync_client_has_the_async_clients_calls(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # the README and the SDK said "the same calls without asyncio"; list_jobs, update_policy, list_envs and
    # describe_env were the async client's alone (an AttributeError in a trainer without asyncio)
    job_id = await _finished_job(fake_client, policy_server, task_ids[:1])
    public = {n for n in dir(EnvfleetClient) if not n.startswith("_")} - {"close"}
    assert public <= {n for n in dir(SyncEnvfleetClient) if not n.startswith("_")}

    def run() -> None:
        with SyncEnvfleetClient(fake_orchestrator.address) as c:
            assert job_id in {j.job_id for j in c.list_jobs()}
            assert "python-tool" in {e.name for e in c.list_envs()}
            assert c.describe_env("python-tool").num_tasks > 0
            with pytest.raises(grpc.aio.AioRpcError, match="can no longer change"):  # the server's own answer
                c.update_policy(job_id, "v2")

    await asyncio.wait_for(asyncio.to_thread(run), 20)


def test_a_sync_client_closed_by_another_thread_ends_the_read_that_waits() -> None:
    # close() left a reader on another thread waiting on a call its loop would never run: a trainer that shut down
    # on its main thread while its loader thread read (here in the stream's retry loop, the server unreachable) never
    # exited
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    c = SyncEnvfleetClient(address, reconnect_s=60)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            next(c.rollouts("job-1"))
        except BaseException as e:
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(1.0)
    assert reader.is_alive()  # waiting out the outage
    c.close()
    reader.join(5.0)
    assert not reader.is_alive(), "the reader still waits on the closed client"
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "closed" in str(errors[0]), errors


def test_a_sync_client_refused_at_its_start_leaves_no_thread_behind() -> None:
    before = {t for t in threading.enumerate() if t.name == "envfleet-client"}
    for _ in range(3):
        with pytest.raises(ValueError, match="in clear"):
            SyncEnvfleetClient("10.1.2.3:50051", token="secret")
    assert {t for t in threading.enumerate() if t.name == "envfleet-client"} == before


_INTERRUPTED = """
import faulthandler, os, signal, sys, threading
from orchestrator.client.sdk import SyncEnvfleetClient

faulthandler.dump_traceback_later(20, exit=True)  # a hang ends with every thread's stack on stderr
# Ctrl-C as in a terminal: a process started in the background (a CI run under nohup, say) inherits SIGINT
# ignored, and Python then installs no handler for it
signal.signal(signal.SIGINT, signal.default_int_handler)

c = SyncEnvfleetClient(sys.argv[1])
it = c.rollouts(sys.argv[2], max_in_flight=1, max_batch=1, auto_ack=False)
next(it)  # the window is full now: nothing more comes
if sys.argv[3] == "process":  # the kernel gives it to a thread of its choosing
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
else:  # to the client's loop thread, never the main one
    threading.Timer(0.5, signal.pthread_kill, (c._thread.ident, signal.SIGINT)).start()
try:
    next(it)
except KeyboardInterrupt:
    print("interrupted", flush=True)
it.close()
c.close()
print("closed", flush=True)
"""


@pytest.mark.parametrize("to", ["process", "loop thread"])
async def test_ctrl_c_while_a_sync_iterator_waits_is_a_keyboard_interrupt_and_ends_its_stream(
    fake_orchestrator: Orchestrator,
    fake_client: EnvfleetClient,
    policy_server: ScriptedServer,
    task_ids: list[str],
    to: str,
) -> None:
    # the interrupt came while the next item was awaited on the client's loop; closing the iterator then tried to
    # close a generator still running there: a RuntimeError replaced the KeyboardInterrupt (a trainer's handler for
    # it never ran), and the stream stayed open on the server. And a SIGINT that reached another thread (gRPC's,
    # the loop's) never woke the main thread blocked on the item's future: it hung ("loop thread")
    job_id = await _finished_job(fake_client, policy_server, task_ids[:3])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _INTERRUPTED, fake_orchestrator.address, job_id, to.split()[0], cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0 and out.decode().split() == ["interrupted", "closed"], err.decode()[-2000:]
    listeners = fake_orchestrator.jobs._jobs[job_id].listeners
    async with asyncio.timeout(10):
        while listeners:  # noqa: ASYNC110 - the job's listeners have no event to wait on
            await asyncio.sleep(0.05)


def _failing_ack(code: grpc.StatusCode, times: int, ack: Any) -> Any:
    """An ack that fails with `code` its first `times` calls, then goes through."""
    calls: list[int] = []

    async def failing(job_id: str, up_to: int = 0, ids: object = ()) -> int:
        calls.append(up_to)
        if len(calls) <= times:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="refused by the test")
        return int(await ack(job_id, up_to=up_to))

    failing.calls = calls  # type: ignore[attr-defined]
    return failing


async def test_a_failed_auto_ack_is_raised_while_the_reader_waits_on_a_full_window(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the window (2) is full of consumed rollouts when their ack fails: no batch comes until something is acked, and
    # the failure was raised only at the next batch, so the reader waited for ever
    monkeypatch.setattr(fake_client, "ack", _failing_ack(grpc.StatusCode.PERMISSION_DENIED, 1, fake_client.ack))
    job_id = await _finished_job(fake_client, policy_server, task_ids[:4])
    got: list[str] = []
    with pytest.raises(grpc.aio.AioRpcError, match="refused by the test"):
        async with asyncio.timeout(20):
            async for r in fake_client.rollouts(job_id, max_in_flight=2, max_batch=2):
                got.append(r.id)
    assert len(got) == 2
    assert (await fake_client.get_job(job_id)).acked == 0  # they come again to the next reader


async def test_an_auto_ack_past_its_deadline_is_sent_again(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # an ack is idempotent, so one that ran past its deadline on a busy server is tried again, not raised
    failing = _failing_ack(grpc.StatusCode.DEADLINE_EXCEEDED, 1, fake_client.ack)
    monkeypatch.setattr(fake_client, "ack", failing)
    job_id = await _finished_job(fake_client, policy_server, task_ids[:4])
    async with asyncio.timeout(20):
        got = [r.id async for r in fake_client.rollouts(job_id, max_in_flight=2, max_batch=2)]
    assert sorted(got) == sorted(f"{job_id}:{t}:0" for t in task_ids[:4])
    assert len(failing.calls) >= 2 and (await fake_client.get_job(job_id)).acked == 4


@pytest.mark.parametrize("groups", [False, True], ids=["rollouts", "groups"])
async def test_big_rollouts_come_in_messages_a_client_with_grpcs_default_limit_reads(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, task_ids: list[str], groups: bool
) -> None:
    # 16 rollouts of about 700 KB each: one message of all of them is past gRPC's default 4 MiB receive limit, the
    # limit of a trainer in most languages that set none (and, past 64 MiB, of every client and of the server)
    script = Script(default=[Step(content="x" * 700_000)])
    server = await start_scripted_server(script, tokens=False)
    try:
        job_id = await fake_client.submit(job(server.url, task_ids[:8], n=2, deliver_groups=groups))
        assert await until_done(fake_client, job_id, 16, timeout_s=60) == 16
    finally:
        await server.close()
    got: list[str] = []
    async with grpc.aio.insecure_channel(fake_orchestrator.address) as channel:  # gRPC's own defaults
        stub = pb_grpc.RolloutServiceStub(channel)
        async for batch in stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, max_batch=64)):
            assert batch.ByteSize() <= 4 << 20
            got += [r.id for r in batch.rollouts] + [r.id for g in batch.groups for r in g.rollouts]
            if groups:
                assert all(len(g.rollouts) == 2 for g in batch.groups), "a group is never split"
    assert sorted(got) == sorted({f"{job_id}:{t}:{i}" for t in task_ids[:8] for i in range(2)})


async def test_a_group_over_a_message_comes_in_parts_that_groups_joins(tmp_path: Path, task_ids: list[str]) -> None:
    # a group went in one message whatever its size: past the server's max_message_bytes (GRPO's 16 samples of long
    # episodes pass 64 MiB) its stream failed at every try, and nothing of the job after it was ever delivered; and
    # it was read whole into the control plane's memory (1,024 samples of 8 MiB episodes: gigabytes a stream)
    script = Script(default=[Step(content="x" * 1_400_000)])
    server = await start_scripted_server(script, tokens=False)
    try:
        async with (
            serve(
                tmp_path / "data", backend=FAKE, max_message_bytes=4 << 20, sandboxes={"max_output": 1 << 20}
            ) as orch,
            EnvfleetClient(orch.address) as client,
        ):
            job_id = await client.submit(job(server.url, task_ids[:2], n=4, deliver_groups=True))
            assert await until_done(client, job_id, 8, timeout_s=60) == 8
            reads: list[int] = []
            read = orch.jobs.store.read

            async def counted(*args: Any, **kwargs: Any) -> list[LogEntry]:
                entries = await read(*args, **kwargs)
                reads.append(sum(len(e.wire or e.payload) for e in entries))
                return entries

            orch.jobs.store.read = counted  # type: ignore[method-assign]
            parts: list[tuple[str, int, bool]] = []
            async with grpc.aio.insecure_channel(orch.address) as channel:  # gRPC's own defaults
                stub = pb_grpc.RolloutServiceStub(channel)
                async for batch in stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id)):
                    assert batch.ByteSize() <= 4 << 20
                    parts += [(g.group_id, len(g.rollouts), g.more) for g in batch.groups]
            ids = sorted({p[0] for p in parts})
            assert parts == [(ids[0], 2, True), (ids[0], 2, False), (ids[1], 2, True), (ids[1], 2, False)] or parts == [
                (ids[1], 2, True),
                (ids[1], 2, False),
                (ids[0], 2, True),
                (ids[0], 2, False),
            ]
            assert max(reads) < 3 * 1_500_000  # 3 MiB and the row that crosses them, never a whole group
            groups = [g async for g in client.groups(job_id)]  # joined, then acked whole
            assert sorted(g.group_id for g in groups) == ids
            for g in groups:
                assert sorted(r.sample_index for r in g.rollouts) == [0, 1, 2, 3] and len(g.advantages) == 4
                assert {r.group_id for r in g.rollouts} == {g.group_id}
            assert (await client.get_job(job_id)).acked == 8
    finally:
        await server.close()


async def test_a_group_in_parts_carries_the_whole_groups_advantages_and_failed_count(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, task_ids: list[str]
) -> None:
    # each part is some of the group's samples: their advantages and its failed count are the whole group's, made
    # from the log's status and reward of every member, never from the part alone
    job_id = await fake_client.submit(job(REPLAY_URL, task_ids[:1], n=4, deliver_groups=True))
    assert await until_done(fake_client, job_id, 4, timeout_s=60) == 4
    outcomes = [
        (RolloutStatus.OK, 0.0),
        (RolloutStatus.OK, 1.0),
        (RolloutStatus.INFRA_ERROR, None),
        (RolloutStatus.OK, 0.25),
    ]
    store = fake_orchestrator.jobs.store
    for k, (status, reward) in enumerate(outcomes):
        member = long_rollout(turns=2, job_id=job_id, tool_output="x" * 1_200_000).model_copy(
            update={
                "id": f"{job_id}:extra:{k}",
                "task_id": "extra",
                "group_id": f"{job_id}:extra",
                "sample_index": k,
                "status": status,
                "reward": reward,
            }
        )
        await store.append(member, visible=False)
    assert await store.publish_complete_groups(job_id, 4) == 1
    async with asyncio.timeout(30):
        extra = [g async for g in fake_client.groups(job_id) if g.task_id == "extra"]
    (group,) = extra
    assert [r.sample_index for r in group.rollouts] == [0, 1, 2, 3]
    assert group.advantages == group_advantages([reward for _, reward in outcomes]) and group.failed == 1
    assert group.advantages[1] is not None and group.advantages[1] > 0 and group.advantages[2] is None


async def _first_message(stub: Any, job_id: str, resume_after: int) -> Any:
    """The first message of a stream of `job_id` after `resume_after` (grpc.aio.EOF when it ends at once)."""
    call = stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id, resume_after=resume_after))
    try:
        async with asyncio.timeout(30):
            return await call.read()
    finally:
        call.cancel()


async def test_a_cursor_inside_a_group_sends_the_group_again_whole_and_one_of_another_job_is_refused(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, task_ids: list[str]
) -> None:
    # a trainer that read a group's first part and resumed after its last seq got the rest as a group of its own,
    # its advantages made of that rest alone; and seqs are shared by every job: another job's seq, below what this
    # job sent, skipped this job's unacked rollouts up to it (nothing acked, nothing sent again, the stream ended)
    stub = fake_client.rollout_stub
    grouped = await fake_client.submit(job(REPLAY_URL, task_ids[:1], n=4, deliver_groups=True))
    assert await until_done(fake_client, grouped, 4, timeout_s=60) == 4
    (whole,) = (await _first_message(stub, grouped, 0)).groups
    inside = whole.rollouts[1].seq
    (again,) = (await _first_message(stub, grouped, inside)).groups
    assert [(r.id, r.advantage) for r in again.rollouts] == [(r.id, r.advantage) for r in whole.rollouts]
    assert await _first_message(stub, grouped, whole.rollouts[-1].seq) is grpc.aio.EOF  # after its end: the end

    first = await fake_client.submit(job(REPLAY_URL, task_ids[:2]))
    assert await until_done(fake_client, first, 2, timeout_s=60) == 2
    other = await fake_client.submit(job(REPLAY_URL, task_ids[:1]))
    assert await until_done(fake_client, other, 1, timeout_s=60) == 1
    between = (await _first_message(stub, other, 0)).rollouts[0].seq
    late = long_rollout(turns=1, job_id=first).model_copy(update={"id": f"{first}:late:0", "task_id": "late"})
    assert (seq := await fake_orchestrator.jobs.store.append(late)) is not None and seq > between
    sent = [r async for r in fake_client.rollouts(first, auto_ack=False)]
    assert len(sent) == 3 and min(r.seq for r in sent) < between < max(r.seq for r in sent)
    refused = stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=first, resume_after=between))
    await expect_error(refused, grpc.StatusCode.INVALID_ARGUMENT, f"resume_after={between} is no seq of job {first}")


@pytest.mark.parametrize("damage", ["status from the future", "JSON cut short"])
@pytest.mark.parametrize("groups", [False, True], ids=["rollouts", "groups"])
async def test_a_row_this_version_cannot_stream_goes_out_as_an_infra_error_and_the_rest_follows(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, task_ids: list[str], groups: bool, damage: str
) -> None:
    # a row of the log that no longer converts (an older version's, a status or field since gone) raised in the
    # stream at every try: the SDK gave up after its reconnect time, and nothing of the job after it was delivered
    job_id = await fake_client.submit(job(REPLAY_URL, task_ids[:3], n=2 if groups else 1, deliver_groups=groups))
    total = 6 if groups else 3
    assert await until_done(fake_client, job_id, total, timeout_s=60) == total
    with contextlib.closing(sqlite3.connect(fake_orchestrator.jobs.store.path)) as db, db:
        (bad,) = db.execute(
            "SELECT rollout_id FROM rollouts WHERE job_id = ? ORDER BY seq LIMIT 1", (job_id,)
        ).fetchone()
        edit = "json_set(payload, '$.status', 'FROM_THE_FUTURE')" if damage.startswith("status") else "'{\"id\": '"
        db.execute(f"UPDATE rollouts SET payload = {edit}, wire = NULL WHERE rollout_id = ?", (bad,))
    advantages: dict[str, float | None] = {}
    async with asyncio.timeout(30):
        if groups:
            whole = [g async for g in fake_client.groups(job_id)]
            got = [r for g in whole for r in g.rollouts]
            advantages = {r.id: a for g in whole for r, a in zip(g.rollouts, g.advantages, strict=True)}
        else:
            got = [r async for r in fake_client.rollouts(job_id)]
    assert sorted(r.id for r in got) == sorted(f"{job_id}:{t}:{i}" for t in task_ids[:3] for i in range(total // 3))
    [unreadable] = [r for r in got if r.id == bad]
    assert unreadable.status == RolloutStatus.INFRA_ERROR and unreadable.reward is None
    assert unreadable.error is not None and unreadable.error.kind == "UnreadableLogEntry"
    assert advantages.get(bad) is None  # nothing to weigh: no advantage, whatever its row's columns say
    assert all(r.status == RolloutStatus.OK for r in got if r.id != bad)


class _BrokenAfterAPart(pb_grpc.RolloutServiceServicer):  # type: ignore[misc]
    """A stream that sends a group's first part and breaks, then, on the next stream, the group from its start."""

    def __init__(self) -> None:
        self.streams: list[int] = []  # resume_after of each stream
        self.acks: list[int] = []

    async def StreamRollouts(self, request: pb.StreamRolloutsRequest, context: grpc.aio.ServicerContext) -> Any:
        self.streams.append(request.resume_after)
        members = [
            pb.Rollout(
                id=f"j:t:{k}", job_id="j", group_id="j:t", sample_index=k, seq=10 + k, status=pb.ROLLOUT_STATUS_OK
            )
            for k in range(4)
        ]
        yield pb.RolloutBatch(groups=[pb.Group(group_id="j:t", rollouts=members[:2], more=True)])
        if len(self.streams) == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server went away")
        yield pb.RolloutBatch(groups=[pb.Group(group_id="j:t", rollouts=members[2:])])

    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.AckResponse:
        self.acks.append(request.up_to)
        return pb.AckResponse(acked=4)


@pytest.mark.parametrize("reader", ["groups", "rollout_messages"])
async def test_a_group_whose_stream_breaks_after_a_part_is_read_from_its_start_again(reader: str) -> None:
    servicer = _BrokenAfterAPart()
    server = grpc.aio.server()
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with EnvfleetClient(f"127.0.0.1:{port}", reconnect_s=30) as client:
            async with asyncio.timeout(30):
                if reader == "groups":
                    got = [[r.id for r in g.rollouts] async for g in client.groups("j")]
                else:
                    got = [[m.id async for m in client.rollout_messages("j")]]
        # one group, its four samples once each: the part before the break was not kept twice, nor acked alone (an
        # ack inside a group before its last part is sent acks none of it)
        assert got == [[f"j:t:{k}" for k in range(4)]]
        assert servicer.streams == [0, 0] and servicer.acks == [13]
    finally:
        await server.stop(None)


async def test_rollouts_logged_behind_one_over_a_messages_bytes_go_out_while_the_job_runs(
    fake_client: EnvfleetClient, task_ids: list[str]
) -> None:
    # a read stopped at its bytes (a first rollout over them alone) looked like the log's end: the rest already
    # logged waited for the next result to wake the stream, minutes apart when rollouts are long
    big = [Step(content="x" * (3_200_000))]
    script = Script(default=big, tasks={task_ids[3]: [Step(hang=True)]})  # the job runs on: its last never ends
    server = await start_scripted_server(script, tokens=False)
    try:
        job_id = await fake_client.submit(job(server.url, task_ids[:4], max_concurrency=4))
        assert await until_done(fake_client, job_id, 3, timeout_s=60) == 3
        got: list[str] = []
        async with asyncio.timeout(10):
            async for r in fake_client.rollouts(job_id):
                got.append(r.task_id)
                if len(got) == 3:
                    break
        assert sorted(got) == sorted(task_ids[:3])
        await fake_client.cancel_job(job_id)
    finally:
        await server.close()


def test_a_message_ends_within_its_bytes_on_a_groups_end_and_a_big_first_group_goes_in_parts() -> None:
    def entries(*groups: str) -> list[LogEntry]:
        return [LogEntry(seq=i + 1, group_id=g, payload="{}", wire=b"x" * 10) for i, g in enumerate(groups)]

    def seqs(message: tuple[list[LogEntry], bool]) -> tuple[list[int], bool]:
        return [e.seq for e in message[0]], message[1]

    assert _within_bytes(entries("a", "b", "c"), 30) == 3
    assert _within_bytes(entries("a", "b", "c"), 25) == 2
    assert _within_bytes(entries("a", "b", "c"), 5) == 1  # the first goes, by itself
    # whole groups that fit together, not half of the next
    assert seqs(_grouped_message(entries("a", "a", "b", "b"), 35, cut=False, continuing=False)) == ([1, 2], False)
    # a read that ends by itself ends on a group's end; one cut may end inside its last group
    assert seqs(_grouped_message(entries("a", "a", "b", "b"), 40, cut=False, continuing=False)) == ([1, 2, 3, 4], False)
    assert seqs(_grouped_message(entries("a", "a", "b", "b"), 40, cut=True, continuing=False)) == ([1, 2], False)
    # a first group over the bytes alone, or cut by the read, or the rest of one in parts: a part within the bytes
    assert seqs(_grouped_message(entries("a", "a", "a", "b"), 15, cut=False, continuing=False)) == ([1], True)
    assert seqs(_grouped_message(entries("a", "a", "a", "a"), 25, cut=True, continuing=False)) == ([1, 2], True)
    assert seqs(_grouped_message(entries("a", "b", "b"), 100, cut=False, continuing=True)) == ([1], True)


async def test_rollout_messages_are_the_rollouts_models_as_they_came_and_acked_the_same(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    job_id = await fake_client.submit(job(policy_server.url, task_ids[:6], n=2, max_concurrency=4))
    assert await until_done(fake_client, job_id, 12, timeout_s=60) == 12
    models = {r.id: r async for r in fake_client.rollouts(job_id, auto_ack=False)}
    # a reader that stops after 5 has acked what it consumed; the next one gets the rest, each once
    head: list[pb.Rollout] = []
    async for m in fake_client.rollout_messages(job_id, max_batch=5):
        head.append(m)
        if len(head) == 5:
            break
    tail = [m async for m in fake_client.rollout_messages(job_id, resume_after=head[-1].seq)]
    messages = head + tail
    assert sorted(m.id for m in messages) == sorted(models)
    # the same rollout, token ids and logprobs included, as the models' reader gets it
    assert all(rollout_from_pb(m) == models[m.id] for m in messages)
    assert any(m.tokens.completion_ids for m in messages)
    assert (await fake_client.get_job(job_id)).acked == 12


async def test_a_reader_with_auto_ack_holds_the_keys_of_a_window_not_of_the_whole_job(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the keys kept to drop what a reconnect sends again grew with the job: a million rollouts, a million ids
    from orchestrator.client import sdk

    sizes: list[int] = []

    class Measured(sdk._Seen):
        def add(self, key: str, seq: int) -> bool:
            new = super().add(key, seq)
            sizes.append(len(self))
            return new

    monkeypatch.setattr(sdk, "_Seen", Measured)
    job_id = await fake_client.submit(job(policy_server.url, task_ids[:20], n=10, max_concurrency=200))
    assert await until_done(fake_client, job_id, 200, timeout_s=60) == 200
    async with asyncio.timeout(30):
        ids = [r.id async for r in fake_client.rollouts(job_id, max_in_flight=16, max_batch=4)]
    assert len(set(ids)) == len(ids) == 200
    assert max(sizes) <= 8, max(sizes)  # the batch being read, and the one before it until it is sent in
    assert (await fake_client.get_job(job_id)).acked == 200


async def test_a_reader_that_acks_by_itself_keeps_a_windows_keys_not_the_jobs(
    fake_client: EnvfleetClient, policy_server: ScriptedServer, task_ids: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # without auto_ack the SDK never learned what was acked: it kept every rollout's id to drop what a reconnect
    # sends again (a million-rollout job, a million ids), and a reconnect resumed at the first seq
    from orchestrator.client import sdk

    made: list[sdk._Seen] = []

    class Recorded(sdk._Seen):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(sdk, "_Seen", Recorded)
    job_id = await fake_client.submit(job(policy_server.url, task_ids[:32]))
    read, most = 0, 0
    async for r in fake_client.rollouts(job_id, auto_ack=False, max_batch=4, max_in_flight=8):
        await fake_client.ack(job_id, up_to=r.seq)
        read += 1
        most = max(most, len(made[0]))
    assert read == 32 and most <= 8, most
