"""Rollout workers on one host: a control plane and worker processes (real subprocesses, real gRPC, real Docker).
A worker killed, or stopped and cut off, mid-job: every rollout of the job is still delivered once after dedup, none
as a fake reward, and no sandbox is left behind."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path, PosixPath

import docker
import httpx
import pytest
from rich.console import Console

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.backends.docker.config import DockerBackendConfig
from orchestrator.backends.docker.sweeper import LABEL_OWNER, LABEL_PID
from orchestrator.backends.pool import TENANT_LABEL, PoolConfig
from orchestrator.cli.status import fetch_status, render_status
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import ConfigError
from orchestrator.core.models import Rollout, RolloutStatus
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.testing.scripted_policy import ScriptedServer
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.spawn import LocalWorkers
from tests.conftest import TEST_OWNER, owned_containers
from tests.orchestrator.conftest import job
from tests.orchestrator.servers import check_delivery, until_done


@pytest.fixture
async def plane(tmp_path: Path, base_image: str) -> AsyncIterator[Orchestrator]:
    """A control plane with 2 local worker processes; a silent worker is lost after 3 s."""
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=DockerBackendConfig(owner=TEST_OWNER),
            workers=2,
            worker_heartbeat_timeout_s=3.0,
        )
    )
    try:
        assert orch.workers is not None
        await orch.workers.hub.wait_for_workers(2, timeout_s=120)
        yield orch
    finally:
        await orch.stop(grace=1)
    left = owned_containers()
    assert not left, f"sandboxes left behind after stop: {[c.name for c in left]}"


async def _collect(client: EnvfleetClient, job_id: str, during: asyncio.Task[int] | None = None) -> list[Rollout]:
    got = [r async for r in client.rollouts(job_id)]
    if during is not None:
        await during
    return got


async def test_a_job_spreads_over_two_workers(
    plane: Orchestrator, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    assert plane.workers is not None and plane.workers.local is not None
    async with EnvfleetClient(plane.address) as client:
        job_id = await client.submit(job(policy_server.url, task_ids[:32], n=2, max_concurrency=16))
        rollouts = await _collect(client, job_id)
    check_delivery(rollouts, {f"{job_id}:{t}:{k}" for t in task_ids[:32] for k in range(2)})
    assert all(r.status == RolloutStatus.OK for r in rollouts)
    served = [w.served for w in plane.workers.hub.workers()]
    assert len(served) == 2 and all(n > 0 for n in served), f"each worker should have served rollouts: {served}"
    # the control plane ran none itself: its own process holds no rollout sandbox
    assert sum(served) == 64
    # the workers keep their recycled sandboxes warm in pools of the job's tenant (here the local one)
    warm = docker.from_env().containers.list(
        ignore_removed=True, filters={"label": [f"{TENANT_LABEL}=local", f"{LABEL_OWNER}={TEST_OWNER}"]}
    )
    assert warm, "rollouts on workers must take sandboxes from their tenant's pool"


async def _lose_a_worker_midway(plane: Orchestrator, client: EnvfleetClient, job_id: str, how: signal.Signals) -> int:
    assert plane.workers is not None and plane.workers.local is not None
    await until_done(client, job_id, 8, timeout_s=300, poll_s=0.2)
    victim = plane.workers.local.pids[0]
    os.kill(victim, how)
    return victim


async def test_a_worker_killed_mid_job_loses_nothing(
    plane: Orchestrator, slow_policy: ScriptedServer, task_ids: list[str]
) -> None:
    assert plane.workers is not None and plane.workers.local is not None
    async with EnvfleetClient(plane.address) as client:
        job_id = await client.submit(job(slow_policy.url, task_ids[:32], n=2, max_concurrency=16))
        kill = asyncio.create_task(_lose_a_worker_midway(plane, client, job_id, signal.SIGKILL))
        rollouts = await _collect(client, job_id, kill)
        info = await client.get_job(job_id)
    check_delivery(rollouts, {f"{job_id}:{t}:{k}" for t in task_ids[:32] for k in range(2)})
    assert plane.workers.hub.lost >= 1
    assert plane.workers.local.restarts >= 1, "the killed worker is started again"
    # retried on the other worker: within the job's infra budget, so every rollout still scored
    assert info.by_status.get(RolloutStatus.OK, 0) == 64, info.by_status


async def test_a_stopped_worker_is_cut_off_and_its_work_done_elsewhere(
    plane: Orchestrator, slow_policy: ScriptedServer, task_ids: list[str]
) -> None:
    assert plane.workers is not None and plane.workers.local is not None
    async with EnvfleetClient(plane.address) as client:
        job_id = await client.submit(job(slow_policy.url, task_ids[:24], max_concurrency=12))
        victim = await _lose_a_worker_midway(plane, client, job_id, signal.SIGSTOP)
        try:
            rollouts = await _collect(client, job_id)
        finally:
            os.kill(victim, signal.SIGCONT)
        info = await client.get_job(job_id)
    check_delivery(rollouts, {f"{job_id}:{t}:0" for t in task_ids[:24]})
    assert info.by_status.get(RolloutStatus.OK, 0) == 24, info.by_status
    assert plane.workers.hub.lost >= 1
    # resumed, the stopped worker finds its stream gone, drops its rollouts (and their sandboxes) and joins again
    await plane.workers.hub.wait_for_workers(2, timeout_s=60)


async def test_a_worker_that_stays_silent_is_killed_and_its_sandboxes_swept(
    plane: Orchestrator, slow_policy: ScriptedServer, task_ids: list[str]
) -> None:
    # cut off and never resumed (hung, stopped for good), it held its sandboxes until their lease, an hour at least
    assert plane.workers is not None and plane.workers.local is not None
    plane.workers.local.lost_kill_s = 2.0
    async with EnvfleetClient(plane.address) as client:
        job_id = await client.submit(job(slow_policy.url, task_ids[:24], max_concurrency=12))
        victim = await _lose_a_worker_midway(plane, client, job_id, signal.SIGSTOP)
        held = [c.name for c in owned_containers() if c.labels.get(LABEL_PID) == str(victim)]
        assert held, "the stopped worker should hold sandboxes"
        rollouts = await _collect(client, job_id)
    check_delivery(rollouts, {f"{job_id}:{t}:0" for t in task_ids[:24]})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (victim in plane.workers.local.pids or _any_left(held)):  # noqa: ASYNC110
        await asyncio.sleep(0.2)
    assert victim not in plane.workers.local.pids, "the silent worker should be killed"
    assert not _any_left(held), "its sandboxes should be swept by the worker started in its place"
    assert plane.workers.local.restarts >= 1
    await plane.workers.hub.wait_for_workers(2, timeout_s=60)


def _any_left(names: list[str]) -> bool:
    return bool({c.name for c in owned_containers()} & set(names))


async def test_a_slow_worker_is_waited_for_not_cut_off(
    plane: Orchestrator, slow_policy: ScriptedServer, task_ids: list[str]
) -> None:
    # stopped for a second, under the 3 s cut-off: its rollouts stall, then finish where they were, once each
    assert plane.workers is not None and plane.workers.local is not None
    async with EnvfleetClient(plane.address) as client:
        job_id = await client.submit(job(slow_policy.url, task_ids[:24], max_concurrency=12))
        victim = await _lose_a_worker_midway(plane, client, job_id, signal.SIGSTOP)
        try:
            await asyncio.sleep(1.0)
            stalled = [w.running for w in plane.workers.hub.workers() if w.pid == victim]
        finally:
            os.kill(victim, signal.SIGCONT)
        assert stalled and stalled[0] > 0, f"the stopped worker should hold rollouts: {stalled}"
        rollouts = await _collect(client, job_id)
        info = await client.get_job(job_id)
    check_delivery(rollouts, {f"{job_id}:{t}:0" for t in task_ids[:24]})
    assert info.by_status.get(RolloutStatus.OK, 0) == 24, info.by_status
    assert plane.workers.hub.lost == 0, "a worker slower than usual, but under the cut-off, is not lost"
    assert all(r.attempts == 1 for r in rollouts), "nothing was retried elsewhere"
    assert victim in plane.workers.local.pids and plane.workers.local.restarts == 0


async def test_an_archive_goes_once_per_worker_stream(tmp_path: Path) -> None:
    """An uploaded environment's bytes ride on the first assignment of it to a stream; later ones name its digest."""
    import hashlib

    from environments.python_tool import PythonToolEnv
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.service.archives import ArchiveCatalog, Shipment
    from orchestrator.worker.hub import WorkerHub, _Worker
    from tests.orchestrator.servers import FAKE

    path = tmp_path / "env.tar"
    path.write_bytes(b"the archive")
    digest = hashlib.sha256(b"the archive").hexdigest()
    env = PythonToolEnv()
    catalog = ArchiveCatalog()
    catalog.add(env, Shipment("harbor", env.name, env.version, digest, path, ""))
    hub = WorkerHub(FakeBackend(FAKE).images, archives=catalog)
    one, two = _Worker("w1", "h", 1, 1), _Worker("w2", "h", 1, 2)
    first, again, other = [await hub._archive_for(w, env) for w in (one, one, two)]
    assert first is not None and first.archive == b"the archive" and first.sha256 == digest
    assert again is not None and again.archive == b"" and again.sha256 == digest
    assert other is not None and other.archive == b"the archive"  # another stream: sent again
    assert await hub._archive_for(one, PythonToolEnv()) is None  # not the instance registered from the archive


async def test_an_archive_goes_again_to_a_worker_that_failed_its_assignment(tmp_path: Path) -> None:
    # the archive may be what failed there (it did not load): without its bytes again, every later assignment of it
    # to that worker failed the same way for the stream's life
    import hashlib

    from environments.python_tool import PythonToolEnv
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.rollout.runner import WorkItem
    from orchestrator.service.archives import ArchiveCatalog, Shipment
    from orchestrator.worker.hub import WorkerHub, WorkerLostError, _Running, _Worker
    from protos import worker_pb2 as wpb
    from tests.orchestrator.servers import FAKE

    path = tmp_path / "env.tar"
    path.write_bytes(b"the archive")
    env = PythonToolEnv()
    catalog = ArchiveCatalog()
    catalog.add(env, Shipment("harbor", env.name, env.version, hashlib.sha256(b"the archive").hexdigest(), path, ""))
    hub = WorkerHub(FakeBackend(FAKE).images, archives=catalog)
    worker = _Worker("w1", "h", 1, 1)
    first = await hub._archive_for(worker, env)
    assert first is not None and first.archive
    answer = asyncio.get_running_loop().create_future()
    item = WorkItem("j", env.tasks()[0], 0, time.monotonic())
    now = time.monotonic()
    worker.running["a1"] = _Running(item, answer, budget_s=60.0, sent=now, deadline=now + 60, archive=first.sha256)
    hub._deliver(worker, wpb.RolloutResult(assignment_id="a1", error="worker w1 cannot run it: OSError: disk full"))
    with pytest.raises(WorkerLostError):
        answer.result()
    again = await hub._archive_for(worker, env)
    assert again is not None and again.archive == b"the archive"


async def test_a_worker_lost_while_its_assignment_is_made_loses_no_rollout(tmp_path: Path) -> None:
    # the assignment waits for the environment's archive to be read (a thread) before it is queued: a worker
    # dropped meanwhile had the rollout queued to its closed stream, and it waited for an answer forever, its slot
    # with it
    import hashlib

    from environments.python_tool import PythonToolEnv
    from orchestrator.backends.fake import FakeBackend
    from orchestrator.core.models import JobSpec, TaskSelection
    from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
    from orchestrator.rollout.runner import WorkItem
    from orchestrator.service.archives import ArchiveCatalog, Shipment
    from orchestrator.worker.hub import WorkerHub
    from protos import worker_pb2 as wpb
    from tests.orchestrator.servers import FAKE

    class SlowArchive(PosixPath):
        def read_bytes(self) -> bytes:
            time.sleep(0.5)  # a large archive
            return b"the archive"

    env = PythonToolEnv()
    catalog = ArchiveCatalog()
    catalog.add(
        env, Shipment("harbor", env.name, env.version, hashlib.sha256(b"x").hexdigest(), SlowArchive(tmp_path), "")
    )
    hub = WorkerHub(FakeBackend(FAKE).images, archives=catalog)
    ends = {"w1": asyncio.Event(), "w2": asyncio.Event()}

    async def stream(worker_id: str) -> list[wpb.ControlMessage]:
        async def inbound() -> AsyncIterator[wpb.WorkerMessage]:
            yield wpb.WorkerMessage(heartbeat=wpb.Heartbeat())
            await ends[worker_id].wait()

        hello = wpb.WorkerHello(worker_id=worker_id, host="h", slots=1, pid=1)
        return [m async for m in hub.attach(hello, inbound(), trusted=False)]

    spec = JobSpec(
        env=env.ref(), tasks=TaskSelection(kind="all"), policy=PolicyEndpoint(base_url=REPLAY_URL), rollout_timeout_s=30
    )
    one = asyncio.create_task(stream("w1"))
    await hub.wait_for_workers(1)
    rollout = asyncio.create_task(hub.run(WorkItem("j", env.tasks()[0], 0, time.monotonic()), env, spec))
    await asyncio.sleep(0.1)  # reading the archive
    ends["w1"].set()  # w1's stream ends: it is dropped
    await one
    two = asyncio.create_task(stream("w2"))
    await hub.wait_for_workers(1)
    for _ in range(200):  # retried on w2, which holds it
        if hub._workers["w2"].running:
            break
        await asyncio.sleep(0.05)
    assert hub._workers["w2"].running
    assert not rollout.done()
    rollout.cancel()
    await asyncio.gather(rollout, return_exceptions=True)
    assert hub._in_use == 0  # its slot came back
    await hub.close()
    ends["w2"].set()
    await two


async def test_the_metrics_endpoint_serves_every_workers_metrics_labelled(
    tmp_path: Path, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # the sandboxes, pools and engine calls are the workers': without their heartbeats' snapshots the control
    # plane's endpoint would show no acquire at all (the control plane ran none)
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=FakeBackendConfig(owner=TEST_OWNER),
            workers=2,
            metrics_port=0,
        )
    )
    try:
        assert orch.workers is not None
        await orch.workers.hub.wait_for_workers(2, timeout_s=120)
        ids = {w.worker_id for w in orch.workers.hub.workers()}
        async with EnvfleetClient(orch.address) as client:
            job_id = await client.submit(job(policy_server.url, task_ids[:8], n=2, max_concurrency=16))
            assert len([r async for r in client.rollouts(job_id)]) == 16
        url = f"http://127.0.0.1:{orch.metrics_port}/metrics"
        async with httpx.AsyncClient() as h, asyncio.timeout(30):
            while True:  # a worker's heartbeat carries its metrics every 5 s
                text = (await h.get(url)).text
                samples = fetch_status(url)
                acquires: dict[str | None, float] = {}
                for lab, v in samples.get("envfleet_sandbox_acquire_seconds_count", []):  # warm and cold
                    acquires[lab.get("worker")] = acquires.get(lab.get("worker"), 0) + v
                if sum(acquires.values()) == 16:
                    break
                await asyncio.sleep(0.5)
        # one acquire per rollout, each counted once, under the worker that made it; both served some
        assert set(acquires) <= ids and sum(1 for v in acquires.values() if v) == 2, acquires
        assert all(lab.get("host") for lab, _ in samples["envfleet_sandbox_acquire_seconds_count"])
        # the control plane's own series stay as they were, and every family is declared once
        assert 'envfleet_rollouts_total{status="OK"} 16.0' in text
        # the workers themselves: with none connected or every slot taken a rollout waits, counted in flight, and
        # the fleet looked busy while it ran nothing
        slots = sum(w.slots for w in orch.workers.hub.workers())
        for line in ("envfleet_workers 2.0", f"envfleet_worker_slots {slots:.1f}", "envfleet_workers_lost_total 0.0"):
            assert line in text.splitlines(), line
        assert "envfleet_rollouts_waiting_for_worker 0.0" in text.splitlines()
        types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types)), [t for t in types if types.count(t) > 1]
        table = Console(width=200, record=True)
        table.print(render_status(samples))
        assert "sandboxes idle" in table.export_text()
    finally:
        await orch.stop(grace=1)


async def test_a_hosts_workers_split_its_idle_budget(
    tmp_path: Path, base_image: str, policy_server: ScriptedServer, task_ids: list[str]
) -> None:
    # max_idle_total is what the host keeps warm: two workers with a pool each keep that between them, not twice it
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=DockerBackendConfig(owner=TEST_OWNER),
            pool=PoolConfig(max_idle_total=2, max_idle_per_pool=2),
            workers=2,
            max_in_flight=16,
        )
    )
    try:
        assert orch.workers is not None
        await orch.workers.hub.wait_for_workers(2, timeout_s=120)
        async with EnvfleetClient(orch.address) as client:
            job_id = await client.submit(job(policy_server.url, task_ids[:16], max_concurrency=16))
            assert len([r async for r in client.rollouts(job_id)]) == 16
        assert all(w.served for w in orch.workers.hub.workers())  # 8 slots each: both held sandboxes
        # the sandboxes past the budget are removed as they come back, each a docker rm that a loaded host may take
        # seconds over; unsplit budgets would keep four warm for good, so wait for two and no more
        engine = docker.from_env()
        deadline = time.monotonic() + 60
        while True:
            warm = engine.containers.list(filters={"label": [f"{LABEL_OWNER}={TEST_OWNER}"]}, ignore_removed=True)
            if len(warm) <= 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert len(warm) <= 2, [c.name for c in warm]
    finally:
        await orch.stop(grace=1)


async def test_a_failed_start_leaves_no_worker_running(tmp_path: Path) -> None:
    # the port is taken: the start fails after the workers, the pool and the backend's sweeper began, and each is
    # stopped again (the workers ran on, for as long as this process lived)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    config = OrchestratorConfig(
        port=taken.getsockname()[1],
        data_dir=tmp_path / "data",
        backend=FakeBackendConfig(owner=TEST_OWNER),
        workers=2,
        metrics_port=None,
    )
    try:
        with pytest.raises(ConfigError, match=r"cannot listen on .* \(--host, --port\): the port is taken"):
            await create_server(config)
    finally:
        taken.close()
    deadline = time.monotonic() + 30
    while _my_workers() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    assert _my_workers() == []


def _my_workers() -> list[int]:
    """The worker processes this process started that still run."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = PosixPath(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = PosixPath(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"orchestrator.worker" in argv and str(os.getpid()).encode() in argv and state != "Z":
            found.append(int(pid))
    return found


def _local_workers(tmp_path: Path) -> LocalWorkers:
    """One supervised worker process that dials a socket nobody serves (it keeps trying until it is stopped)."""
    config = WorkerConfig(backend=FakeBackendConfig(owner=TEST_OWNER))
    return LocalWorkers(1, f"unix:{tmp_path}/nobody.sock", "token", config)


async def test_a_worker_that_could_not_be_started_is_started_again(tmp_path: Path) -> None:
    # an OSError from the spawn (fds or memory short for a moment) ended the slot's supervisor: one worker fewer for
    # good, said nowhere until the control plane stopped
    workers = _local_workers(tmp_path)
    spawn, failures = workers._spawn, [OSError(24, "Too many open files")]

    async def flaky(index: int) -> asyncio.subprocess.Process:
        if failures:
            raise failures.pop()
        return await spawn(index)

    workers._spawn = flaky  # type: ignore[method-assign]
    workers.start()
    try:
        deadline = time.monotonic() + 30
        while not workers.pids and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        assert len(workers.pids) == 1 and not failures
    finally:
        await workers.stop(grace_s=10)
    assert _my_workers() == []


async def test_a_worker_started_while_the_others_stop_is_stopped_too(tmp_path: Path) -> None:
    # stop() signalled the processes it found; one its supervisor was starting meanwhile was neither signalled nor
    # waited for, and ran on while this process lived
    workers = _local_workers(tmp_path)
    spawn, spawned = workers._spawn, asyncio.Event()

    async def slow(index: int) -> asyncio.subprocess.Process:
        proc = await spawn(index)  # the process runs: its supervisor has not taken it back yet
        spawned.set()
        await asyncio.sleep(30)  # stop() comes meanwhile, and cancels this supervisor here
        return proc

    workers._spawn = slow  # type: ignore[method-assign]
    workers.start()
    await spawned.wait()
    await workers.stop(grace_s=10)
    assert workers.pids == [] and _my_workers() == []


async def test_a_workers_restart_delay_starts_over_after_it_ran_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the delay only doubled: a control plane up for a week waited 30 s to restart any worker after a few exits
    from orchestrator.worker import spawn as spawn_module

    monkeypatch.setattr(spawn_module, "RESTART_RESET_S", 1.0)
    workers = _local_workers(tmp_path)
    caplog.set_level(logging.WARNING, logger=spawn_module.__name__)

    def delays() -> list[str]:
        return [r.getMessage().rsplit(" ", 1)[1] for r in caplog.records if "starting it again" in r.getMessage()]

    workers.start()
    try:
        async with asyncio.timeout(30):
            for exits in range(3):
                while len(workers.pids) != 1 or len(delays()) != exits:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                if exits == 2:
                    await asyncio.sleep(1.2)  # this one ran past RESTART_RESET_S; the two before exited at once
                os.kill(workers.pids[0], signal.SIGKILL)
            while len(delays()) < 3:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert delays() == ["0.5s", "1s", "0.5s"], delays()
    finally:
        await workers.stop(grace_s=10)


async def test_a_connect_cancelled_while_it_joins_leaves_no_worker_behind() -> None:
    # a Connect cancelled while it waited for the join lock (taken just then by the waiters another worker woke)
    # left its worker registered: its slots counted, and picked first, with nobody to read its outbox
    import contextlib

    from orchestrator.backends.fake import FakeBackend
    from orchestrator.worker.hub import WorkerHub
    from protos import worker_pb2 as wpb
    from tests.orchestrator.servers import FAKE

    hub = WorkerHub(FakeBackend(FAKE).images)

    async def inbound() -> AsyncIterator[wpb.WorkerMessage]:
        await asyncio.Event().wait()
        yield wpb.WorkerMessage()  # pragma: no cover - never reached

    hello = wpb.WorkerHello(worker_id="w1", host="h", slots=4, pid=1)
    async with hub._joined:  # held, as a woken waiter holds it
        stream = hub.attach(hello, inbound(), trusted=False)
        joining = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)  # registered, and waiting for the lock
        joining.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await joining
    assert hub.workers() == [] and hub._slots == 0
