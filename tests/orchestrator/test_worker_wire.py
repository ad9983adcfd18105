"""The worker wire's own behaviour, with a scripted worker on a real socket: assignments placed together travel
together, a slow worker is waited for (not cut off) and its rollouts come back once, a rollout past its budget is
given up and stopped on the worker, and the outbox that batches both directions."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import grpc
import pytest

from orchestrator.core.models import EncodedRollout, JobSpec, Rollout, RolloutError, RolloutStatus
from orchestrator.rollout.runner import WorkItem
from orchestrator.server.convert import rollout_pb
from orchestrator.service.registry import Registry
from orchestrator.worker import hub
from orchestrator.worker.outbox import Outbox, as_messages, by_size
from orchestrator.worker.results import encode
from protos import orchestrator_pb2 as pb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tests.conftest import until
from tests.orchestrator.worker_wire import ENV, TOKEN, ScriptedWorker, Wire, items, rollout_for, serve_hub, spec


async def _answer(a: wpb.Assignment) -> wpb.RolloutResult:
    return encode(a.assignment_id, rollout_for(a))


async def test_assignments_placed_together_travel_in_one_message() -> None:
    async with serve_hub() as w, ScriptedWorker(w.tcp, _answer) as worker:
        await w.hub.wait_for_workers(1, timeout_s=30)
        batch = items("job-batch", 40)
        env = Registry.from_entry_points().get(ENV)
        job = spec([i.task.id for i in batch])
        got = await asyncio.wait_for(asyncio.gather(*(w.hub.run(i, env, job) for i in batch)), 60)
    assert all(isinstance(r, EncodedRollout) and r.status == RolloutStatus.OK for r in got), got
    assert sorted(r.id for r in got) == sorted(i.id for i in batch)
    assert len(worker.assignments) == 40
    # placed in one turn of the loop, they left in one message (at most a few, never one each)
    assert worker.assign_messages < 5, worker.assign_messages


async def test_a_slow_worker_is_waited_for_and_each_rollout_comes_back_once() -> None:
    async def slow(a: wpb.Assignment) -> wpb.RolloutResult:
        await asyncio.sleep(2.0)  # slower than the cut-off; it keeps sending heartbeats meanwhile
        return encode(a.assignment_id, rollout_for(a))

    async with serve_hub(heartbeat_timeout_s=1.0) as w, ScriptedWorker(w.tcp, slow, heartbeat_s=0.2) as worker:
        await w.hub.wait_for_workers(1, timeout_s=30)
        batch = items("job-slow", 8)
        env = Registry.from_entry_points().get(ENV)
        job = spec([i.task.id for i in batch])
        got = await asyncio.wait_for(asyncio.gather(*(w.hub.run(i, env, job) for i in batch)), 60)
        lost = w.hub.lost
    assert lost == 0, "a slow worker that still checks in is not cut off"
    assert [r.id for r in got] == [i.id for i in batch]
    assert all(isinstance(r, EncodedRollout) and r.status == RolloutStatus.OK for r in got), got
    assert len(worker.assignments) == 8 and not worker.cancelled


async def test_a_stall_of_the_control_planes_own_loop_cuts_off_no_worker() -> None:
    # the control plane's host starved of CPU: its loop does not run for twice the cut-off, and neither can it hear
    # anyone meanwhile; silence it could not have heard is not a lost worker (the worker shares this loop here, so
    # it is stalled too, as a worker on a starved host would be)
    async def quick(a: wpb.Assignment) -> wpb.RolloutResult:
        return encode(a.assignment_id, rollout_for(a))

    async with serve_hub(heartbeat_timeout_s=2.0) as w, ScriptedWorker(w.tcp, quick, heartbeat_s=0.2):
        await w.hub.wait_for_workers(1, timeout_s=30)
        await asyncio.sleep(0.5)
        time.sleep(4.0)  # the stall under test
        await asyncio.sleep(3.0)  # past the cut-off again, now awake: heartbeats are heard
        batch = items("job-stall", 4)
        env = Registry.from_entry_points().get(ENV)
        got = await asyncio.wait_for(asyncio.gather(*(w.hub.run(i, env, spec([i.task.id])) for i in batch)), 60)
        assert w.hub.lost == 0, "the control plane's own stall cut a worker off"
    assert all(isinstance(r, EncodedRollout) and r.status == RolloutStatus.OK for r in got), got


@contextlib.contextmanager
def _spinning() -> Iterator[subprocess.Popen[bytes]]:
    """A real process of this host that keeps using CPU, as a worker's does."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


@contextlib.asynccontextmanager
async def _silent_worker(over: str) -> AsyncIterator[tuple[Wire, ScriptedWorker, int]]:
    """A hub (1 s cut-off) and a worker that never sends a heartbeat, connected `over` "unix" or "tcp", whose
    hello names a spinning process of this host as its pid, one the hub counts as its own: (hub, worker, pid)."""
    with _spinning() as spinner:
        async with serve_hub(heartbeat_timeout_s=1.0) as w:
            w.hub.local_pids = lambda: (spinner.pid,)
            async with ScriptedWorker(getattr(w, over), _answer, heartbeat_s=None, pid=spinner.pid) as worker:
                await w.hub.wait_for_workers(1, timeout_s=30)
                yield w, worker, spinner.pid


async def test_a_silent_local_worker_that_still_uses_cpu_is_starved_not_lost() -> None:
    # on a host at a load of 100 a worker's heartbeats miss the cut-off while it still works; dropping it would
    # retry its rollouts and destroy their sandboxes, which is how a loaded host collapses. Here the worker's
    # process is a real one that spins; stopped (SIGSTOP, as a partition is simulated), it is lost
    async with _silent_worker("unix") as (w, worker, pid):
        await asyncio.sleep(4.0)  # silent for four cut-offs
        assert (w.hub.lost, len(w.hub.workers())) == (0, 1)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.wait_for(worker.ended(), 10)
        assert (w.hub.lost, w.hub.workers()) == (1, [])


async def test_a_silent_local_worker_that_uses_cpu_is_lost_once_stuck_that_long() -> None:
    # a loop stuck in an environment's synchronous code uses CPU as a starved one does: it was kept for good, its
    # slots counted as capacity and its rollouts waiting out their whole budgets (half an hour by default)
    async with _silent_worker("unix") as (w, worker, _):
        t0 = time.monotonic()
        await asyncio.wait_for(worker.ended(), 30)
        assert time.monotonic() - t0 >= hub.STARVED_CUTOFFS - 1  # kept for that many 1 s cut-offs first
        assert (w.hub.lost, w.hub.workers()) == (1, [])


async def test_a_silent_remote_worker_is_lost_whatever_runs_under_its_pid() -> None:
    # a worker over TCP may be another host's process: its pid means nothing here
    async with _silent_worker("tcp") as (w, worker, _):
        await asyncio.wait_for(worker.ended(), 10)
        assert w.hub.lost == 1


async def test_a_remote_worker_with_a_cut_off_local_workers_pid_does_not_count_as_it_rejoining() -> None:
    # a Ray actor on another host may have any pid (small ones in containers): taken for the local worker joined
    # again, the stopped local process was never killed, and kept its slot and its sandboxes for good
    told: list[tuple[int, bool]] = []
    async with _silent_worker("unix") as (w, _, pid):
        w.hub.on_local_lost = lambda lost, rejoined: told.append((lost, rejoined(lost)))
        async with ScriptedWorker(w.tcp, _answer, worker_id="remote", pid=pid):
            await w.hub.wait_for_workers(2, timeout_s=30)
            os.kill(pid, signal.SIGSTOP)
            async with asyncio.timeout(10):
                while not told:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
    assert told == [(pid, False)]


async def test_a_lost_workers_rollouts_wait_for_room_rather_than_overload_the_others() -> None:
    running, peak = 0, 0

    async def counted(a: wpb.Assignment) -> wpb.RolloutResult:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(0.3)
        finally:
            running -= 1
        return encode(a.assignment_id, rollout_for(a))

    async def never(a: wpb.Assignment) -> None:
        await asyncio.sleep(3600)

    batch = items("job-room", 6)
    env = Registry.from_entry_points().get(ENV)
    job = spec([i.task.id for i in batch], max_infra_retries=1)
    async with serve_hub() as w, ScriptedWorker(w.tcp, counted, worker_id="steady", slots=2) as steady:
        doomed = ScriptedWorker(w.tcp, never, worker_id="doomed", slots=2)
        await doomed.__aenter__()
        await w.hub.wait_for_workers(2, timeout_s=30)
        runs = asyncio.gather(*(w.hub.run(i, env, job) for i in batch))
        for _ in range(200):
            if len(doomed.assignments) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(doomed.assignments) == 2, "two slots each: the doomed worker holds two"
        await doomed.__aexit__(None, None, None)  # its stream ends: lost, its two rollouts retried
        got = await asyncio.wait_for(runs, 60)
    assert all(isinstance(r, EncodedRollout) and r.status == RolloutStatus.OK for r in got), got
    assert peak == 2, f"the surviving worker held {peak} rollouts at once with 2 slots"
    assert len(steady.assignments) == 6


async def test_a_worker_that_cannot_run_a_rollout_is_not_given_its_retry_nor_new_work() -> None:
    # a worker that cannot load the environment answers each assignment with an error, at once: the retry went back
    # to it (the group's home, and the least loaded), so each rollout spent its retries there and ended INFRA_ERROR
    # while a sound worker stood idle
    async def broken(a: wpb.Assignment) -> wpb.RolloutResult:
        return wpb.RolloutResult(assignment_id=a.assignment_id, error="no such environment plug-in here")

    batch = items("job-broken", 3)
    env = Registry.from_entry_points().get(ENV)
    job = spec([i.task.id for i in batch], max_infra_retries=2)
    async with serve_hub() as w, ScriptedWorker(w.tcp, broken, worker_id="broken") as bad:
        await w.hub.wait_for_workers(1, timeout_s=30)
        async with ScriptedWorker(w.tcp, _answer, worker_id="sound") as good:
            await w.hub.wait_for_workers(2, timeout_s=30)
            got = [await asyncio.wait_for(w.hub.run(i, env, job), 60) for i in batch]
    assert all(isinstance(r, EncodedRollout) and r.status == RolloutStatus.OK for r in got), got
    assert len(bad.assignments) == 1 and len(good.assignments) == 3, (len(bad.assignments), len(good.assignments))
    assert isinstance(got[0], EncodedRollout) and got[0].attempts == 2  # its one failed attempt is counted
    # and the retry went with the attempt spent: the job's retries are one budget, each worker's runner retried an
    # infrastructure failure up to all of them again ((R+1)^2 attempts in all, each up to the rollout's time)
    assert [a.attempts_spent for a in good.assignments] == [1, 0, 0]


async def test_a_worker_whose_host_fails_its_rollouts_is_not_given_the_next_ones() -> None:
    # a worker whose engine is down answers each rollout INFRA_ERROR at once (its own retries spent there): it
    # looked the least loaded, and every other rollout went to it to fail the same way
    async def host_down(a: wpb.Assignment) -> wpb.RolloutResult:
        error = RolloutError(kind="EngineError", message="the engine did not answer")
        return encode(a.assignment_id, rollout_for(a, status=RolloutStatus.INFRA_ERROR, reward=None, error=error))

    batch = items("job-host-down", 4)
    env = Registry.from_entry_points().get(ENV)
    job = spec([i.task.id for i in batch])
    async with serve_hub() as w, ScriptedWorker(w.tcp, host_down, worker_id="down", host="a") as down:
        await w.hub.wait_for_workers(1, timeout_s=30)
        async with ScriptedWorker(w.tcp, _answer, worker_id="sound", host="b") as sound:
            await w.hub.wait_for_workers(2, timeout_s=30)
            got = [await asyncio.wait_for(w.hub.run(i, env, job), 60) for i in batch]
    assert [r.status for r in got].count(RolloutStatus.INFRA_ERROR) <= 1, got
    assert len(down.assignments) <= 1 and len(sound.assignments) >= 3, (len(down.assignments), len(sound.assignments))
    # a plug-in environment's assignment says what the control plane's is, for the worker to check its own against
    from orchestrator.core.environment import environment_digest

    assert {a.env_digest for a in sound.assignments} == {environment_digest(env)}


def _held_until(go: asyncio.Event) -> Callable[[wpb.Assignment], Awaitable[wpb.RolloutResult]]:
    """A scripted worker's answer once `go` is set."""

    async def held(a: wpb.Assignment) -> wpb.RolloutResult:
        await go.wait()
        return await _answer(a)

    return held


async def test_new_rollouts_go_to_a_worker_whose_engine_answers_while_it_has_room() -> None:
    # a rollout placed on a worker whose engine is down (a dockerd restarting) waits for it, minutes at most, while
    # another host could run it now; such a worker took its share of new rollouts until waiting ones filled it
    go = asyncio.Event()
    held = _held_until(go)

    batch = items("job-engine-down", 5)
    env = Registry.from_entry_points().get(ENV)
    job = spec([i.task.id for i in batch])
    # the down one says it in its hello, and sends no heartbeat: rollouts that waited for a slot are placed as a
    # worker joins, before its first heartbeat could say it
    async with (
        serve_hub() as w,
        ScriptedWorker(w.tcp, held, worker_id="down", host="a", engine_down=True, heartbeat_s=None) as down,
    ):
        await w.hub.wait_for_workers(1, timeout_s=30)
        async with ScriptedWorker(w.tcp, held, worker_id="up", host="b", slots=3) as up:
            await w.hub.wait_for_workers(2, timeout_s=30)
            assert {(i.worker_id, i.engine_down) for i in w.hub.workers()} == {("down", True), ("up", False)}
            runs = [asyncio.create_task(w.hub.run(i, env, job)) for i in batch]
            await until(lambda: len(up.assignments) + len(down.assignments) == 5, "all were placed")
            # the worker whose engine answers takes what it has room for; the rest go to the other rather than wait
            assert (len(up.assignments), len(down.assignments)) == (3, 2)
            go.set()
            got = await asyncio.wait_for(asyncio.gather(*runs), 60)
            assert [r.status for r in got] == [RolloutStatus.OK] * 5


async def test_a_groups_samples_leave_a_home_whose_engine_is_down_only_for_a_worker_whose_engine_answers() -> None:
    # a group's samples go where its first ran (its snapshots are there); a home whose engine went down keeps them
    # while no worker whose engine answers has room (one host's workers share one engine, and on another worker
    # whose engine is down they would wait all the same), and loses them to one that has
    first, *rest = [WorkItem("job-home", items("job-home", 1)[0].task, i, time.monotonic(), "local") for i in range(3)]
    elsewhere = items("job-home", 2)[1]  # another group's rollout, which fills the one worker whose engine answers
    env = Registry.from_entry_points().get(ENV)
    job = spec([first.task.id, elsewhere.task.id])
    go = asyncio.Event()
    held = _held_until(go)

    async with serve_hub() as w, ScriptedWorker(w.tcp, _answer, worker_id="home", host="a") as home:
        await w.hub.wait_for_workers(1, timeout_s=30)
        # on one host (both have the image: that does not keep the group home)
        async with ScriptedWorker(w.tcp, _answer, worker_id="other", host="a", engine_down=True) as other:
            await w.hub.wait_for_workers(2, timeout_s=30)
            await asyncio.wait_for(w.hub.run(first, env, job), 30)
            home.engine_down = True
            await until(lambda: all(i.engine_down for i in w.hub.workers()), "both engines down")
            async with ScriptedWorker(w.tcp, held, worker_id="busy", host="b", slots=1) as busy:
                await w.hub.wait_for_workers(3, timeout_s=30)
                filler = asyncio.create_task(w.hub.run(elsewhere, env, job))
                await until(lambda: len(busy.assignments) == 1, "the answering worker is full")
                await asyncio.wait_for(w.hub.run(rest[0], env, job), 30)
                assert ([a.sample_index for a in home.assignments], other.assignments) == ([0, 1], [])
                go.set()
                await asyncio.wait_for(filler, 30)
                await asyncio.wait_for(w.hub.run(rest[1], env, job), 30)
    assert [(a.task_id, a.sample_index) for a in busy.assignments] == [(elsewhere.task.id, 0), (first.task.id, 2)]
    assert other.assignments == []


async def test_rollouts_waiting_for_a_down_engine_move_to_other_hosts_as_their_room_allows() -> None:
    # a rollout whose retry waits for its engine (a dockerd restarting) held its slot up to engine_outage_wait_s,
    # 5 minutes by default, while a worker of another host could run it now (and a training step waits for its
    # slowest rollout); not at once (a dockerd back in a few seconds is waited for), and never to a worker of the
    # same host, which shares the engine (its own heartbeats may not say so yet)
    async def never(a: wpb.Assignment) -> None:
        return None

    go = asyncio.Event()
    held = _held_until(go)

    batch = items("job-move", 3)
    env = Registry.from_entry_points().get(ENV)
    job = spec([i.task.id for i in batch], max_infra_retries=1)
    async with (
        serve_hub(engine_move_after_s=1.0) as w,
        ScriptedWorker(w.tcp, never, worker_id="down", host="a") as down,
    ):
        await w.hub.wait_for_workers(1, timeout_s=30)
        runs = [asyncio.create_task(w.hub.run(i, env, job)) for i in batch]
        try:
            await until(lambda: len(down.assignments) == 3, "placed on the one worker")
            async with (
                ScriptedWorker(w.tcp, _answer, worker_id="sibling", host="a") as sibling,
                ScriptedWorker(w.tcp, held, worker_id="elsewhere", host="b", slots=1) as elsewhere,
            ):
                await w.hub.wait_for_workers(3, timeout_s=30)
                # its engine goes down: two of its rollouts wait for it (the third runs on a warm sandbox, say)
                down.engine_waits = [batch[0].id, batch[1].id]
                down.engine_down = True
                await until(lambda: [i.engine_waits for i in w.hub.workers() if i.engine_down] == [2], "said")
                # the heartbeat that first says so moves nothing
                assert [i.running for i in w.hub.workers() if i.worker_id == "down"] == [3]
                await until(lambda: len(elsewhere.assignments) == 1, "one moved, once down for a second")
                await asyncio.sleep(1.5)  # three more of its heartbeats
                assert len(down.cancelled) == 1 and len(elsewhere.assignments) == 1  # all the room it had
                go.set()  # it has room again: the other follows
                got = await asyncio.wait_for(asyncio.gather(*runs[:2]), 30)
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
    assert [(r.status, r.attempts) for r in got] == [(RolloutStatus.OK, 2)] * 2  # the wait counted one attempt
    assert sorted(down.cancelled) == sorted(a.assignment_id for a in down.assignments[:2])
    assert {a.task_id for a in elsewhere.assignments} == {batch[0].task.id, batch[1].task.id}
    assert sibling.assignments == []


async def test_moves_off_a_down_engine_reserve_the_room_they_take_until_they_are_placed() -> None:
    # two workers of a host whose engine is down, heard in one pass of the loop (their moved rollouts are placed
    # again only when their tasks next run): the second heartbeat counted the room the first's move had taken, and
    # both went to the one free slot (and the rest to a worker of the down host, or over a full one's slots)
    from orchestrator.backends.fake import FakeBackend
    from tests.orchestrator.servers import FAKE

    the_hub = hub.WorkerHub(FakeBackend(FAKE).images, engine_move_after_s=0)
    loop = asyncio.get_running_loop()
    down = [hub._Worker(f"down-{i}", "a", 1, i) for i in (1, 2)]
    for worker, item in zip(down, items("job-room", 2), strict=True):
        now = time.monotonic()
        worker.running[f"a-{worker.id}"] = hub._Running(item, loop.create_future(), 60.0, now, now + 60.0)
    for worker in (*down, hub._Worker("up", "b", 1, 3)):
        the_hub._workers[worker.id] = worker
    for worker in down:
        (running,) = worker.running.values()
        the_hub._take_heartbeat(worker, wpb.Heartbeat(engine_down=True, engine_waits=[running.item.id]))
    moved = [w.id for w in down if w.cancelling]
    assert len(moved) == 1, moved  # the one slot of the one host whose engine answers
    left = [r for w in down for r in w.running.values()]
    assert len(left) == 1 and not left[0].result.done()  # the other waits where it is


async def test_a_jobs_spec_goes_to_a_worker_that_keeps_it_once_and_again_when_it_changed_or_failed() -> None:
    # a job's spec went with each of its assignments: 1-2 KB of the 1.9 KB an assignment was for a job of 60 task
    # ids, and a declarative environment's spec (up to 100,000 tasks, megabytes) went along with it each time
    batch = items("job-specs", 6)
    env = Registry.from_entry_points().get(ENV)
    job = spec([i.task.id for i in batch])
    failing = batch[3].task.id

    async def answer(a: wpb.Assignment) -> wpb.RolloutResult:
        if a.task_id == failing:
            return wpb.RolloutResult(assignment_id=a.assignment_id, error="its environment did not load")
        return encode(a.assignment_id, rollout_for(a))

    async with serve_hub() as w:
        async with ScriptedWorker(w.tcp, answer, worker_id="keeps", keeps_specs=True) as keeps:
            await w.hub.wait_for_workers(1, timeout_s=30)
            for i in batch[:3]:
                await asyncio.wait_for(w.hub.run(i, env, job), 60)
            updated = job.model_copy(update={"policy": job.policy.model_copy(update={"version": "v2"})})
            for i in batch[3:5]:  # the first under the new spec, then the failed one's successor
                await asyncio.wait_for(w.hub.run(i, env, updated), 60)
            w.hub.job_ended("job-specs")
            await asyncio.wait_for(w.hub.run(batch[5], env, updated), 60)
        async with ScriptedWorker(w.tcp, answer, worker_id="older") as older:
            for _ in range(200):  # the first one's stream has ended, and the new one joined
                if [i.worker_id for i in w.hub.workers()] == ["older"]:
                    break
                await asyncio.sleep(0.05)
            for i in batch[:2]:
                await asyncio.wait_for(w.hub.run(i, env, job), 60)
    carried = [JobSpec.model_validate_json(a.job_spec_json) if a.job_spec_json else None for a in keeps.assignments]
    assert [c is not None for c in carried] == [True, False, False, True, True, True], carried
    assert carried[0] == job and carried[3] == updated and carried[4] == updated and carried[5] == updated
    assert all(a.job_spec_json for a in older.assignments) and len(older.assignments) == 2


async def test_rollouts_waiting_for_a_slot_end_when_the_last_worker_is_gone() -> None:
    # one slot, four rollouts: three wait for it; the only worker's stream ends and none joins. The slot freed woke
    # one of them; the others waited for a slot no rollout would free, and their job never ended
    async def never(a: wpb.Assignment) -> None:
        await asyncio.sleep(3600)

    batch = items("job-orphaned", 4)
    env = Registry.from_entry_points().get(ENV)
    job = spec([i.task.id for i in batch], rollout_timeout_s=1)
    async with serve_hub() as w:
        only = ScriptedWorker(w.tcp, never, worker_id="only", slots=1)
        await only.__aenter__()
        await w.hub.wait_for_workers(1, timeout_s=30)
        runs = asyncio.gather(*(w.hub.run(i, env, job) for i in batch))
        for _ in range(200):
            if only.assignments:
                break
            await asyncio.sleep(0.05)
        await only.__aexit__(None, None, None)
        got = await asyncio.wait_for(runs, 30)
    assert all(isinstance(r, Rollout) and r.status == RolloutStatus.INFRA_ERROR for r in got), got


async def test_a_peer_that_never_says_hello_is_let_go() -> None:
    # it holds the token, connects, and sends nothing: the handler waited for its hello for good
    async def silent() -> AsyncIterator[wpb.WorkerMessage]:
        await asyncio.sleep(3600)
        yield wpb.WorkerMessage()

    async with serve_hub(heartbeat_timeout_s=1.0) as w, grpc.aio.insecure_channel(w.tcp) as channel:
        call = wpb_grpc.WorkerServiceStub(channel).Connect(silent(), metadata=(("authorization", f"Bearer {TOKEN}"),))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async with asyncio.timeout(10):
                async for _ in call:
                    pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "must say hello within 1s" in str(e.value.details())


async def test_a_rollout_past_its_budget_is_given_up_and_stopped_on_the_worker() -> None:
    async def never(a: wpb.Assignment) -> None:
        return None  # it checks in, but this rollout never ends

    # the budget: the fleet's part and the episode's (the rollout's timeout each), the longest retry pause (8 s) and
    # the slack; and what a worker said its rollouts may wait for its engine (its hello: 2 s), for a rollout it said
    # its engine was down during (here for a moment). Counted in for every rollout, it held a stuck one 5 minutes
    # longer by default.
    env = Registry.from_entry_points().get(ENV)
    a, b = items("job-stuck", 2)
    job = spec([a.task.id, b.task.id], rollout_timeout_s=0.5)
    async with (
        serve_hub(result_slack_s=0.5) as w,
        ScriptedWorker(w.tcp, never, worker_id="steady", engine_outage_wait_s=2.0, slots=1) as steady,
        ScriptedWorker(w.tcp, never, worker_id="flaky", engine_outage_wait_s=2.0, slots=1) as flaky,
    ):
        await w.hub.wait_for_workers(2, timeout_s=30)
        runs = asyncio.gather(w.hub.run(a, env, job), w.hub.run(b, env, job))  # one each: a worker has one slot
        await until(lambda: bool(steady.assignments and flaky.assignments), "both assigned")
        flaky.engine_down = True
        await until(lambda: any(i.engine_down for i in w.hub.workers()), "its heartbeat said its engine is down")
        flaky.engine_down = False
        await until(lambda: not any(i.engine_down for i in w.hub.workers()), "and back")
        got = await asyncio.wait_for(runs, 60)
        await until(lambda: bool(steady.cancelled and flaky.cancelled), "the cancels reached the workers")
    lost = [r for r in got if isinstance(r, Rollout) and r.status == RolloutStatus.INFRA_ERROR and r.reward is None]
    assert len(lost) == 2, got
    said = sorted(r.error.message if r.error else "" for r in lost)
    assert "worker flaky gave no result within 11.5s" in said[0], said
    assert "worker steady gave no result within 9.5s" in said[1], said
    for worker in (steady, flaky):
        assert worker.cancelled == [worker.assignments[0].assignment_id]


async def test_the_outbox_hands_out_what_is_queued_in_order_and_in_batches() -> None:
    box: Outbox[int] = Outbox(max_batch=3, linger_s=0.0)
    for i in range(7):
        box.put(i)
    assert [await box.get(), await box.get(), await box.get()] == [[0, 1, 2], [3, 4, 5], [6]]
    box.put(7)
    box.close()
    assert await box.get() == [7]
    assert await box.get() == []  # closed and drained: the sender ends


async def test_an_idle_outbox_sends_at_once() -> None:
    box: Outbox[str] = Outbox(linger_s=60.0)
    box.put("first")
    async with asyncio.timeout(5):  # it would wait a minute if it lingered
        assert await box.get() == ["first"]


async def test_a_busy_outbox_lingers_for_more() -> None:
    box: Outbox[str] = Outbox(linger_s=30.0, max_batch=2)
    box.put("a")
    assert await box.get() == ["a"]
    box.put("b")  # right after a batch: busy, so it waits (up to the linger) for the batch to fill
    asyncio.get_running_loop().call_later(0.05, box.put, "c")
    async with asyncio.timeout(10):  # full at two: it goes without waiting out the linger
        assert await box.get() == ["b", "c"]


def test_runs_of_one_kind_become_one_message_each_under_a_byte_cap() -> None:
    msgs = as_messages(
        [1, 2, "x", 3, 40, 5],
        int,
        lambda run: tuple(run),
        size=lambda n: n,
        max_bytes=10,
    )
    assert msgs == [(1, 2), "x", (3,), (40,), (5,)]  # 40 is over the cap alone; order kept
    assert list(by_size([], len, 10)) == []


async def test_a_local_workers_rollout_is_kept_in_both_forms_as_it_came() -> None:
    async with serve_hub() as w, ScriptedWorker(w.unix, _answer):
        await w.hub.wait_for_workers(1, timeout_s=30)
        batch = items("job-forms", 20)
        env = Registry.from_entry_points().get(ENV)
        got = await asyncio.wait_for(
            asyncio.gather(*(w.hub.run(i, env, spec([j.task.id for j in batch])) for i in batch)), 60
        )
    for r in got:
        assert isinstance(r, EncodedRollout)
        assert pb.Rollout.FromString(r.wire) == rollout_pb(r.json)


async def test_an_assignment_over_the_wires_message_size_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # sent, it was over the wire's 64 MiB and ended the worker's stream: every rollout there was retried, and this one
    # went on to end the next worker's stream, and the next. Here the cap is 4 KB and the job's spec is larger
    monkeypatch.setattr(hub, "MAX_ASSIGNMENT_BYTES", 4096)
    answered: list[str] = []

    async def answer(a: wpb.Assignment) -> wpb.RolloutResult:
        answered.append(a.task_id)
        return encode(a.assignment_id, rollout_for(a))

    async with serve_hub() as w, ScriptedWorker(w.unix, answer) as worker:
        await w.hub.wait_for_workers(1, timeout_s=30)
        (small_item,) = items("job-small", 1)
        (big_item,) = items("job-big", 1)
        env = Registry.from_entry_points().get(ENV)
        big = spec([big_item.task.id, *(f"padding-{i:04d}" for i in range(400))], max_infra_retries=3)
        got = await asyncio.wait_for(w.hub.run(big_item, env, big), 30)
        assert isinstance(got, Rollout) and got.status == RolloutStatus.INFRA_ERROR and got.reward is None, got
        assert got.error is not None and got.error.kind == "AssignmentTooLargeError", got.error
        assert "over the worker wire's 4096" in got.error.message and got.attempts == 1
        # the worker was never sent it, and is still there for the next job's rollouts
        ok = await asyncio.wait_for(w.hub.run(small_item, env, spec([small_item.task.id])), 30)
        assert isinstance(ok, EncodedRollout) and ok.status == RolloutStatus.OK
        assert answered == [small_item.task.id] and w.hub.lost == 0 and worker.error is None


async def test_a_host_whose_workers_are_gone_is_forgotten_by_image_placement() -> None:
    # the hosts that ran an environment were kept for good: one entry per host that ever connected, in a fleet whose
    # hosts come and go
    async with serve_hub() as w:
        env = Registry.from_entry_points().get(ENV)
        batch = items("job-hosts", 2)
        async with ScriptedWorker(w.tcp, _answer):
            await w.hub.wait_for_workers(1, timeout_s=30)
            await asyncio.wait_for(w.hub.run(batch[0], env, spec([batch[0].task.id])), 60)
            assert w.hub._hosts_with[env.ref()] == {"scripted-host"}
        async with asyncio.timeout(30):  # the worker's stream is closed: the hub drops it
            while w.hub.workers():  # noqa: ASYNC110 - the hub has no event for it
                await asyncio.sleep(0.05)
        assert env.ref() not in w.hub._hosts_with  # and the environment with its last host


async def test_a_policy_update_serializes_the_jobs_spec_again_not_its_environments() -> None:
    # the declarative environment's spec (up to 100,000 tasks, megabytes) was serialized again at every UpdatePolicy
    from orchestrator.service.declarative import make_environment, parse_spec

    declared = parse_spec(
        {
            "name": "mine",
            "version": "1",
            "tools": ["submit"],
            "tasks": [{"id": f"t{i}", "prompt": f"say {i}"} for i in range(100)],
            "scoring": {"command": "echo '{\"reward\": 1}'"},
        }
    )
    env = make_environment(declared)
    job = spec(["t0"])
    async with serve_hub() as w:
        spec_json, env_json = w.hub._encode("job-update", env, job)
        updated = job.model_copy(update={"policy": job.policy.model_copy(update={"version": "v2"})})
        new_spec_json, new_env_json = w.hub._encode("job-update", env, updated)
    assert new_env_json is env_json and b'"t99"' in env_json
    assert JobSpec.model_validate_json(new_spec_json) == updated and new_spec_json != spec_json
