"""Workers on a real Ray cluster (a head and two sandbox-host nodes on this machine, on loopback, sharing its
Docker engine): both nodes serve rollouts; a node removed mid-job loses nothing and leaves no sandbox behind; a
control plane SIGKILLed mid-job is rejoined by its actors when it restarts, and a normal stop removes them."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import docker
import pytest

from orchestrator.backends.docker.config import DockerBackendConfig
from orchestrator.backends.docker.sweeper import LABEL_OWNER
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import RolloutStatus
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.service.store import ResultStore
from orchestrator.testing.scripted_policy import ScriptedServer
from orchestrator.worker.identity import FLEET_ID_FILE
from orchestrator.worker.ray_fleet import RayConfig, actor_prefix
from tests.conftest import REPO, TEST_OWNER, owned_containers
from tests.orchestrator.conftest import job
from tests.orchestrator.servers import check_delivery, until_done

# `make test-cluster` runs these (.ci/run calls it after `make test`); there a missing Ray fails rather than skips
pytestmark = pytest.mark.cluster
ray_cluster_utils: Any = (
    importlib.import_module("ray.cluster_utils")
    if os.environ.get("ENVFLEET_REQUIRE_CLUSTER") == "1"
    else pytest.importorskip("ray.cluster_utils")
)
RESOURCE = "envfleet_sandbox_host"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """One cluster for the module (its start is the slow part): a head, and sandbox hosts added by `cluster`."""
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def cluster(ray_cluster: Any) -> Any:
    """The module's cluster with two sandbox-host nodes (a test that removed one gets it back)."""
    while len(ray_cluster.worker_nodes) < 2:
        ray_cluster.add_node(num_cpus=1, resources={RESOURCE: 1})
    ray_cluster.wait_for_nodes()
    return ray_cluster


@pytest.fixture
async def ray_plane(tmp_path: Path, base_image: str, cluster: Any) -> AsyncIterator[Orchestrator]:
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=DockerBackendConfig(owner=TEST_OWNER),
            worker_listen="127.0.0.1:0",
            worker_heartbeat_timeout_s=5.0,
            ray=RayConfig(address=cluster.address, resource=RESOURCE, poll_s=1.0),
        )
    )
    try:
        assert orch.workers is not None and orch.workers.ray is not None
        await orch.workers.hub.wait_for_workers(2, timeout_s=240)
        yield orch
    finally:
        await orch.stop(grace=1)
    left = owned_containers()
    assert not left, f"sandboxes left behind: {[c.name for c in left]}"


async def test_a_job_across_two_ray_nodes_survives_losing_one(
    ray_plane: Orchestrator,
    cluster: Any,
    slow_policy: ScriptedServer,
    task_ids: list[str],
) -> None:
    assert ray_plane.workers is not None and ray_plane.workers.ray is not None
    fleet, hub = ray_plane.workers.ray, ray_plane.workers.hub
    assert len(fleet.nodes()) == 2
    async with EnvfleetClient(ray_plane.address) as client:
        job_id = await client.submit(job(slow_policy.url, task_ids[:32], max_concurrency=8))
        for _ in range(1200):
            if len([w for w in hub.workers() if w.served > 0]) == 2:
                break
            await asyncio.sleep(0.1)
        served = {w.worker_id: w.served for w in hub.workers()}
        assert len(served) == 2 and all(served.values()), f"both nodes serve rollouts: {served}"
        # remove the node of one worker (its raylet and its actors die with it)
        victim_node = next(n for n in cluster.worker_nodes if n.node_id in fleet.nodes())
        # what the fleet keeps of a node apart from its workers (a replacement's pause, a loopback warning said)
        fleet._not_before[(victim_node.node_id, 7)] = (0.0, 1.0)
        fleet._unreachable.add(victim_node.node_id)
        cluster.remove_node(victim_node)
        rollouts = [r async for r in client.rollouts(job_id)]
        info = await client.get_job(job_id)
    check_delivery(rollouts, {f"{job_id}:{t}:0" for t in task_ids[:32]})
    assert info.by_status.get(RolloutStatus.OK, 0) == 32, info.by_status
    assert hub.lost >= 1
    for _ in range(100):  # the watcher forgets the dead node
        if len(fleet.nodes()) == 1:
            break
        await asyncio.sleep(0.1)
    assert len(fleet.nodes()) == 1
    # and all it kept of it: nodes of an autoscaled cluster come and go for good
    assert victim_node.node_id not in fleet._unreachable
    assert not [slot for slot in fleet._not_before if slot[0] == victim_node.node_id]


# -- a control plane that restarts: a process of its own, so that it can be SIGKILLed ---------------------------------

NAMESPACE = RayConfig().namespace
Actors = dict[str, dict[str, int]]  # actor name -> its info (pid, sessions)


@pytest.fixture
def ray_probe(cluster: Any) -> Iterator[None]:
    """This test process joins the cluster to look at the worker actors (the control plane is another process)."""
    import ray

    ray.init(address=cluster.address, namespace="envfleet-test-probe", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(data: Path, owner: str, listen: str, cluster: Any) -> tuple[subprocess.Popen[str], str]:
    """`envfleet serve` with Ray workers only, on a fixed worker address; returns it and its API address."""
    argv = [sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0", "--data-dir", str(data)]
    argv += ["--owner", owner, "--worker-listen", listen, "--ray-address", cluster.address, "--ray-resource", RESOURCE]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 240)
    assert line.startswith("listening "), line
    return proc, line.split()[1]


def _actors(fleet_id: str) -> Actors:
    """The fleet's live worker actors and what each says of itself (blocking)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    out: Actors = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != NAMESPACE or not name.startswith(actor_prefix(fleet_id)):
            continue
        try:
            info = cast("dict[str, int]", ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote(), timeout=30))
        except (ValueError, RayActorError, GetTimeoutError):
            continue  # being killed
        out[name] = info
    return out


async def _wait_actors(fleet_id: str, until: Callable[[Actors], bool], timeout_s: float) -> Actors:
    actors: Actors = {}
    for _ in range(int(timeout_s / 0.5)):
        actors = await asyncio.to_thread(_actors, fleet_id)
        if until(actors):
            return actors
        await asyncio.sleep(0.5)
    raise AssertionError(f"the fleet's actors did not get there within {timeout_s:g}s: {actors}")


def _connected(actors: Actors) -> bool:
    return len(actors) == 2 and all(a["sessions"] >= 1 for a in actors.values())


def _pids(actors: Actors) -> dict[str, int]:
    return {name: a["pid"] for name, a in actors.items()}


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


async def _stop_normally(proc: subprocess.Popen[str], fleet_id: str, pids: dict[str, int], owner: str) -> None:
    """SIGTERM the control plane: it exits cleanly, no actor of its fleet survives, no sandbox is left."""
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 180) == 0
    await _wait_actors(fleet_id, lambda actors: not actors, 60)
    for _ in range(120):
        if not any(_running(pid) for pid in pids.values()):
            break
        await asyncio.sleep(0.5)
    assert not [pid for pid in pids.values() if _running(pid)], "the actors' processes outlived a normal stop"
    left = docker.from_env().containers.list(
        ignore_removed=True, all=True, filters={"label": [f"{LABEL_OWNER}={owner}"]}
    )
    assert not left, f"sandboxes left behind: {[c.name for c in left]}"


def _terminate(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(180)


@pytest.mark.timeout(900)
async def test_a_control_plane_killed_mid_job_is_rejoined_by_its_actors(
    tmp_path: Path, base_image: str, cluster: Any, ray_probe: None, slow_policy: ScriptedServer, task_ids: list[str]
) -> None:
    data, owner, listen = tmp_path / "data", f"{TEST_OWNER}-restart", f"127.0.0.1:{_free_port()}"
    ids = task_ids[:24]
    procs: list[subprocess.Popen[str]] = []
    try:
        proc, address = await _serve(data, owner, listen, cluster)
        procs.append(proc)
        fleet_id = (data / FLEET_ID_FILE).read_text().strip()
        before = _pids(await _wait_actors(fleet_id, _connected, 300))
        async with EnvfleetClient(address) as client:
            job_id = await client.submit(job(slow_policy.url, ids, max_concurrency=8))
            done_before = await until_done(client, job_id, 4, timeout_s=300)
        assert 4 <= done_before < len(ids), done_before
        os.kill(proc.pid, signal.SIGKILL)  # a crash: no stop, the actors are not told
        await asyncio.to_thread(proc.wait)
        assert _pids(await asyncio.to_thread(_actors, fleet_id)) == before, "the actors outlive a crashed control plane"

        # restarted on the same data dir and worker address: it resumes the job and finds the same actors by name
        proc, address = await _serve(data, owner, listen, cluster)
        procs.append(proc)
        async with EnvfleetClient(address) as client:
            rollouts = [r async for r in client.rollouts(job_id)]
            info = await client.get_job(job_id)
        check_delivery(rollouts, {f"{job_id}:{t}:0" for t in ids})
        assert info.state == "COMPLETED" and info.by_status.get(RolloutStatus.OK, 0) == len(ids), info.by_status
        after = await asyncio.to_thread(_actors, fleet_id)
        assert _pids(after) == before, "the same actor processes serve the restarted control plane, none placed again"
        assert all(a["sessions"] >= 2 for a in after.values()), f"each actor redialled: {after}"
        await _stop_normally(proc, fleet_id, before, owner)
    finally:
        _terminate(procs)
    store = await ResultStore.open(data / "results.sqlite3")
    try:
        assert len(await store.done_ids(job_id)) == len(ids), "one row per rollout id"
    finally:
        await store.close()


async def test_a_normal_stop_leaves_no_worker_actor(
    tmp_path: Path, base_image: str, cluster: Any, ray_probe: None
) -> None:
    data, owner = tmp_path / "data", f"{TEST_OWNER}-stop"
    procs: list[subprocess.Popen[str]] = []
    try:
        proc, _ = await _serve(data, owner, f"127.0.0.1:{_free_port()}", cluster)
        procs.append(proc)
        fleet_id = (data / FLEET_ID_FILE).read_text().strip()
        actors = await _wait_actors(fleet_id, _connected, 300)
        await _stop_normally(proc, fleet_id, _pids(actors), owner)
    finally:
        _terminate(procs)


@pytest.mark.timeout(600)
async def test_a_slow_local_stop_still_stops_the_ray_actors(
    tmp_path: Path, base_image: str, cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the workers' shutdown stage holds one minute-long wait: the local workers' stop used to take it all, and the
    # Ray actors, stopped after it, were never reached (detached, they stayed on every node holding their sandboxes)
    import ray

    from orchestrator.server import app
    from orchestrator.worker.spawn import LocalWorkers

    monkeypatch.setattr(app, "STOP_STAGE_S", 5.0)  # the workers' stage: 15 s
    local_stop = LocalWorkers.stop

    async def slow_stop(self: LocalWorkers) -> None:
        await local_stop(self)
        await asyncio.sleep(30)  # a host too slow to end its workers' sandboxes within the stage

    monkeypatch.setattr(LocalWorkers, "stop", slow_stop)
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=DockerBackendConfig(owner=TEST_OWNER),
            workers=1,
            worker_listen="127.0.0.1:0",
            ray=RayConfig(address=cluster.address, resource=RESOURCE, poll_s=1.0),
        )
    )
    assert orch.workers is not None and orch.workers.ray is not None
    fleet_id = orch.workers.ray.fleet_id
    try:
        await orch.workers.hub.wait_for_workers(3, timeout_s=240)  # the local one and an actor on each node
    finally:
        await orch.stop(grace=1)
    # (a stop cut short never left the cluster either: that connection is reused, and closed below)
    ray.init(address=cluster.address, namespace="envfleet-test-probe", log_to_driver=False, ignore_reinit_error=True)
    try:
        left = await _wait_actors(fleet_id, lambda actors: not actors, 30)
    except AssertionError:
        left = await asyncio.to_thread(_actors, fleet_id)
        for name in left:  # not to leave them to the module's other tests
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    finally:
        ray.shutdown()
    assert not left, f"worker actors outlived the stop: {sorted(left)}"


async def test_a_ray_worker_stopped_for_good_is_killed_and_replaced(ray_plane: Orchestrator) -> None:
    # a Ray actor stopped (SIGSTOP) or hung is cut off by the hub, but its run never ends: it was never replaced,
    # and held its sandboxes and its node's place until the control plane stopped
    import ray

    assert ray_plane.workers is not None and ray_plane.workers.ray is not None
    fleet, hub = ray_plane.workers.ray, ray_plane.workers.hub
    fleet.silent_s = 3.0  # after the hub's cut-off (5 s here)
    victim = next(p for placed in fleet.placed.values() for p in placed.values())
    info = cast(dict[str, int], await asyncio.to_thread(ray.get, victim.actor.info.remote(), timeout=30))
    pid = int(info["pid"])
    os.kill(pid, signal.SIGSTOP)
    try:
        async with asyncio.timeout(120):
            while fleet.replaced < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            await hub.wait_for_workers(2, timeout_s=240)
            while _alive(pid):  # noqa: ASYNC110 - Ray kills it once it does not answer the graceful stop
                await asyncio.sleep(0.2)
        assert victim.name in {p.name for placed in fleet.placed.values() for p in placed.values()}  # its slot again
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_slot_whose_actors_keep_ending_waits_longer_each_time() -> None:
    # each replacement was placed at once, every poll, however soon the last one had ended
    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import REPLACE_BACKOFF_MAX_S, STEADY_RUN_S, RayWorkers

    fleet = RayWorkers(RayConfig(), "127.0.0.1:1", "token", WorkerConfig(), "fleet")
    slot, pauses = ("node", 0), []
    for _ in range(8):
        fleet._pause(slot, ran_s=0.5, now=100.0)
        pauses.append(fleet._not_before[slot][1])
    assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, REPLACE_BACKOFF_MAX_S, REPLACE_BACKOFF_MAX_S]
    fleet._pause(slot, ran_s=STEADY_RUN_S, now=100.0)  # one that ran a while starts it over
    assert fleet._not_before[slot] == (100.0, 0.0)


def test_ray_settings_that_cannot_work_are_refused_or_said(caplog: pytest.LogCaptureFixture) -> None:
    # an empty resource or namespace passed validation (ray.init raised a traceback on the namespace), and a resource
    # no node advertises placed no worker in silence: the jobs' rollouts waited for one until their timeout
    import logging

    from pydantic import ValidationError

    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import RayWorkers

    for bad in ({"resource": ""}, {"namespace": ""}, {"resource": "a b"}):
        with pytest.raises(ValidationError, match=rf"{next(iter(bad))}\n  String should match pattern"):
            RayConfig(**bad)  # type: ignore[arg-type]
    fleet = RayWorkers(RayConfig(resource="envfleet_sandbox_hots"), "127.0.0.1:1", "token", WorkerConfig(), "fleet")
    nodes = [{"NodeID": "a" * 40, "Alive": True, "Resources": {"CPU": 4.0, "envfleet_sandbox_host": 1.0}}]
    with caplog.at_level(logging.ERROR, logger="orchestrator.worker.ray_fleet"):
        for _ in range(3):
            fleet._say_if_no_host(nodes, any_host=False)
    (said,) = [r.getMessage() for r in caplog.records]  # once, not at every poll
    assert "'envfleet_sandbox_hots'" in said and "advertise: envfleet_sandbox_host" in said, said


async def test_joining_a_cluster_that_is_not_there_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # ray.init's ConnectionError went up as a traceback from `envfleet serve --ray-address`
    import ray

    from orchestrator.core.errors import ConfigError
    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import RayWorkers

    def no_cluster(**kw: object) -> None:
        raise ConnectionError("could not find any running Ray instance")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    fleet = RayWorkers(RayConfig(address="auto"), "127.0.0.1:1", "token", WorkerConfig(), "fleet")
    with pytest.raises(ConfigError, match=r"cannot join the Ray cluster at 'auto': could not find"):
        await fleet.start()


async def test_a_head_address_nothing_answers_is_a_config_error_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # ray.init retried an address nothing answered for minutes, saying nothing; the Ctrl-C that ended it stopped the
    # fleet, whose first Ray call started a local Ray instance on the host
    import socket

    import ray

    from orchestrator.core.errors import ConfigError
    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import RayWorkers

    def no_call(*a: object, **kw: object) -> None:
        raise AssertionError("a Ray call")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    for name in ("init", "get", "wait", "kill", "shutdown"):
        monkeypatch.setattr(ray, name, no_call)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fleet = RayWorkers(RayConfig(address=f"127.0.0.1:{port}"), "127.0.0.1:1", "token", WorkerConfig(), "fleet")
    with pytest.raises(ConfigError, match=rf"cannot join the Ray cluster at '127\.0\.0\.1:{port}': nothing answers"):
        await fleet.start()
    await fleet.stop()  # never joined: nothing to stop, and no Ray of its own


async def test_an_actor_whose_run_failed_ends_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # the run's exception went up past the exit: a detached actor whose worker failed, its control plane gone, lived
    # on for good with its name (orphan_after_s promised it would end)
    import ray

    from orchestrator.worker import process
    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import _Worker

    async def failing(*args: object, **kw: object) -> None:
        raise RuntimeError("the worker failed")

    exits: list[bool] = []
    monkeypatch.setattr(process, "run_worker", failing)
    monkeypatch.setattr(ray.actor, "exit_actor", lambda: exits.append(True))
    actor = _Worker("127.0.0.1:1", "token", WorkerConfig().model_dump_json(), "w", "fp")
    with pytest.raises(RuntimeError, match="the worker failed"):
        await actor.run()
    assert exits == [True]
    # a caller that goes away (the control plane's wait cut short) does not end the actor
    monkeypatch.setattr(process, "run_worker", lambda *a, **kw: asyncio.sleep(30))
    waiting = _Worker("127.0.0.1:1", "token", WorkerConfig().model_dump_json(), "w", "fp")
    call = asyncio.create_task(waiting.run())
    await asyncio.sleep(0.1)
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    assert exits == [True]
    assert waiting._running is not None
    waiting._running.cancel()


async def test_workers_are_placed_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    # one placement after another, each waiting on the cluster (a stale actor's whole teardown when the control
    # plane restarted with a new configuration): 100 nodes of 8 kept the API down for an hour
    import time

    import ray

    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import RayWorkers

    nodes = [{"NodeID": c * 40, "Alive": True, "Resources": {RESOURCE: 1.0}} for c in "ab"]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    fleet = RayWorkers(RayConfig(per_node=4), "10.0.0.1:1", "token", WorkerConfig(), "fleet")
    placed: list[tuple[str, int]] = []

    def slow_place(node: str, index: int) -> None:
        time.sleep(1)
        placed.append((node[0], index))

    fleet._place = slow_place  # type: ignore[assignment,method-assign]
    t0 = time.monotonic()
    await fleet.reconcile()
    assert sorted(placed) == [(c, i) for c in "ab" for i in range(4)]
    assert time.monotonic() - t0 < 3, time.monotonic() - t0  # 8 s one after another


async def test_a_stop_cut_short_still_kills_every_actor_of_the_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    # past the stop's budget only the placed actors were killed: one a placement made as the fleet stopped (in no
    # list yet) ran on for orphan_after_s with its warm pool
    import time
    from types import SimpleNamespace

    import ray

    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import RayWorkers, _Placed, actor_name

    fleet = RayWorkers(RayConfig(), "10.0.0.1:1", "token", WorkerConfig(), "fleet")
    call = SimpleNamespace(remote=lambda: "ref")
    placed = SimpleNamespace(name="placed", stop=call, run=call)
    stray = SimpleNamespace(name="stray")
    fleet.placed = {"n" * 40: {0: _Placed(placed, "run-ref", "n" * 40, actor_name("fleet", "n" * 40, 0), "w")}}
    named = [actor_name("fleet", "n" * 40, 0), actor_name("fleet", "m" * 40, 0)]
    killed: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # joined (stop() of a fleet that never did returns)
    monkeypatch.setattr(ray, "get", lambda *a, **kw: time.sleep(3))  # its teardown takes longer than the budget
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: killed.append(actor.name))
    monkeypatch.setattr(
        ray.util, "list_named_actors", lambda all_namespaces: [{"name": n, "namespace": "envfleet"} for n in named]
    )
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace: stray if name == named[1] else placed)
    stop = asyncio.create_task(fleet.stop())
    await asyncio.sleep(0.3)
    stop.cancel()  # the shutdown's budget ran out
    await asyncio.gather(stop, return_exceptions=True)
    assert killed == ["placed", "stray"]


async def test_a_cluster_that_keeps_failing_is_asked_less_often() -> None:
    # every poll_s, however long the cluster's head had not answered, each with a traceback in the log
    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import RayWorkers

    fleet = RayWorkers(RayConfig(poll_s=0.01), "127.0.0.1:1", "token", WorkerConfig(), "fleet")
    calls = 0

    async def failing() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError("the head does not answer")

    fleet.reconcile = failing  # type: ignore[method-assign]
    watcher = asyncio.create_task(fleet._watch())
    await asyncio.sleep(0.7)  # 0.01 s apart: 70 looks; doubling from 0.01 s: 6
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    assert 3 <= calls <= 8, calls


async def test_a_poll_longer_than_the_backoffs_cap_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.worker import ray_fleet
    from orchestrator.worker.config import WorkerConfig

    fleet = ray_fleet.RayWorkers(RayConfig(poll_s=120), "127.0.0.1:1", "token", WorkerConfig(), "fleet")
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)
        raise asyncio.CancelledError

    monkeypatch.setattr(asyncio, "sleep", sleep)  # the watcher's own sleep: nothing else awaits one meanwhile
    with pytest.raises(asyncio.CancelledError):
        await fleet._watch()
    assert slept == [120]


async def test_actors_dial_a_wildcard_listen_address_by_this_nodes_address(
    tmp_path: Path, base_image: str, cluster: Any
) -> None:
    # --worker-listen 0.0.0.0:PORT was handed to the actors as it was: on any other machine, 0.0.0.0 is that
    # machine, so no actor off this one ever joined (and each sent its token to whatever listened there)
    import ray

    from orchestrator.server.security import SecurityConfig

    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=DockerBackendConfig(owner=TEST_OWNER),
            worker_listen="0.0.0.0:0",
            security=SecurityConfig(insecure=True),  # plaintext off loopback: this test's own cluster
            ray=RayConfig(address=cluster.address, resource=RESOURCE, poll_s=1.0),
        )
    )
    try:
        assert orch.workers is not None and orch.workers.ray is not None
        host = orch.workers.ray.target.rsplit(":", 1)[0]
        assert host == ray.util.get_node_ip_address() and host != "0.0.0.0"  # type: ignore[no-untyped-call]
        await orch.workers.hub.wait_for_workers(2, timeout_s=240)
    finally:
        await orch.stop(grace=1)


def test_an_actors_worker_is_heard_by_its_own_name_only() -> None:
    # the hub's workers are read once a poll (each actor read and scanned them all: 50 s of the loop a poll at 4,096
    # actors); a worker name is heard only from ids of its own, never from another index that starts the same
    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import RayWorkers, _Placed

    reads: list[int] = []

    def connected() -> list[str]:
        reads.append(1)
        return ["ray-abcdef12-10-host-7", "w0-host-8"]

    fleet = RayWorkers(RayConfig(), "127.0.0.1:1", "token", WorkerConfig(), "fleet", connected=connected, join_s=0.0)
    names = fleet._connected_names()
    assert reads == [1] and names is not None
    heard = _Placed(None, None, "abcdef12", "a", "ray-abcdef12-10")
    other = _Placed(None, None, "abcdef12", "b", "ray-abcdef12-1")
    assert not fleet._silent(heard, heard.placed_at + 1, names) and heard.heard
    assert fleet._silent(other, other.placed_at + 1, names) and not other.heard


def test_a_loopback_target_gets_workers_on_this_machines_nodes_only() -> None:
    # an actor on another machine dialed that machine's own loopback, and sent the worker token in clear to whatever
    # listened there; and its 300 s until it was given up on counted as a steady run, so it was placed again at once
    from orchestrator.worker.config import WorkerConfig
    from orchestrator.worker.ray_fleet import RayWorkers, _Placed

    here, there = (
        {"NodeID": "a" * 40, "NodeManagerAddress": "10.0.0.1"},
        {"NodeID": "b" * 40, "NodeManagerAddress": "10.0.0.2"},
    )
    loopback = RayWorkers(RayConfig(), "127.0.0.1:5000", "token", WorkerConfig(), "fleet")
    loopback._local = {"10.0.0.1", "127.0.0.1", "::1"}  # what Ray says this machine is
    assert loopback._reaches(here) and not loopback._reaches(there)
    routable = RayWorkers(RayConfig(), "10.0.0.1:5000", "token", WorkerConfig(), "fleet")
    assert routable._reaches(there)
    never_joined = _Placed(None, None, "b" * 40, "x", "ray-bbbbbbbb-0")
    assert never_joined.ran_s(never_joined.placed_at + 300) == 0.0
    never_joined.heard = True
    assert never_joined.ran_s(never_joined.placed_at + 300) == pytest.approx(300)  # (a + 300) - a, in floats
