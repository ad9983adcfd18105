"""Warm pools and recycling on real Docker: refill, drain, TTL, shared capacity, and isolation between rollouts."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator, Callable

import docker
import pytest

from bench.envd_bench import envd_pid
from orchestrator.backends.config import FakeBackendConfig
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.backends.fake import FakeBackend, FakeSandbox
from orchestrator.backends.pool import PoolConfig, SandboxPool, pool_key, pool_labels
from orchestrator.core.errors import SandboxError
from orchestrator.core.sandbox import Limits, ResetOutcome, Sandbox, SandboxSpec


async def _until(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


@pytest.fixture
async def pool_factory(backend: DockerBackend) -> AsyncIterator[Callable[..., SandboxPool]]:
    pools: list[SandboxPool] = []

    def make(max_sandboxes: int | None = None, **kw: object) -> SandboxPool:
        # max_sandboxes=1 for a test that checks which sandbox comes back: the refiller, which a cold acquire wakes,
        # adds one of its own, and one that lands after the test's release is handed out first (LIFO)
        p = SandboxPool(backend, PoolConfig.model_validate(kw), max_sandboxes=max_sandboxes)  # type: ignore[arg-type]
        p.start()
        pools.append(p)
        return p

    yield make
    for p in pools:
        await p.close()


def _discards(pool: SandboxPool, reason: str) -> float:
    """How many sandboxes the pool destroyed for `reason` (its metric, as Prometheus reads it)."""
    return pool.metrics.registry.get_sample_value("envfleet_pool_discards_total", {"reason": reason}) or 0.0


def _probes(pool: SandboxPool, outcome: str) -> float:
    return pool.metrics.registry.get_sample_value("envfleet_pool_probes_total", {"outcome": outcome}) or 0.0


def _ids(client: docker.DockerClient, owner_instance: str) -> set[str]:
    return {c["Id"] for c in client.api.containers(all=True, filters={"label": f"envfleet.instance={owner_instance}"})}


async def test_refill_and_drain(
    pool_factory: Callable[..., SandboxPool],
    base_image: str,
    backend: DockerBackend,
    docker_client: docker.DockerClient,
) -> None:
    pool: SandboxPool = pool_factory(min_idle_per_pool=2, max_idle_per_pool=4)
    spec = SandboxSpec(image=base_image)
    pool.warm(spec)
    await _until(lambda: pool.idle_total == 2)
    t0 = time.monotonic()
    sb, source = await pool.acquire(spec)
    assert source == "warm" and time.monotonic() - t0 < 1.0
    assert (await sb.exec(["echo", "hi"])).stdout == b"hi\n"
    await _until(lambda: pool.idle_total == 2)  # refilled behind the acquire
    await pool.release(sb, recycle=False)
    await pool.close()
    await _until(lambda: not _ids(docker_client, backend.owner.instance), timeout=20)


async def test_idle_sandboxes_expire(pool_factory: Callable[..., SandboxPool], base_image: str) -> None:
    pool: SandboxPool = pool_factory(idle_ttl_s=1.0)
    spec = SandboxSpec(image=base_image)
    sb, _ = await pool.acquire(spec)
    assert await pool.release(sb, recycle=True)
    assert pool.idle_total == 1
    await _until(lambda: pool.idle_total == 0, timeout=10)
    assert _discards(pool, "expired") == 1


async def test_capacity_is_shared_between_pools(pool_factory: Callable[..., SandboxPool], base_image: str) -> None:
    pool: SandboxPool = pool_factory(max_idle_total=1, max_idle_per_pool=1)
    a = SandboxSpec(image=base_image, limits=Limits(memory_mb=256))
    b = SandboxSpec(image=base_image, limits=Limits(memory_mb=512))
    sa, _ = await pool.acquire(a)
    sb, _ = await pool.acquire(b)
    assert await pool.release(sa, recycle=True)
    assert await pool.release(sb, recycle=True)  # evicts a's idle sandbox rather than starving b
    assert pool.idle_total == 1 and _discards(pool, "evicted") == 1
    got, source = await pool.acquire(b)
    assert source == "warm" and got.id == sb.id
    await pool.release(got, recycle=False)


async def test_docker_exec_sandboxes_are_never_recycled(
    pool_factory: Callable[..., SandboxPool], base_image: str
) -> None:
    pool: SandboxPool = pool_factory()
    sb, _ = await pool.acquire(SandboxSpec(image=base_image, transport="docker-exec"))
    assert not await pool.release(sb, recycle=True)
    assert pool.idle_total == 0


MARKERS = (
    "for d in /tmp /workspace /dev/shm /run/envd; do echo secret > $d/.marker-$RANDOM; mkdir -p $d/sub; "
    "echo x > $d/sub/f; done"
)


async def test_recycled_sandbox_keeps_nothing_from_the_previous_rollout(
    pool_factory: Callable[..., SandboxPool], base_image: str
) -> None:
    pool: SandboxPool = pool_factory()
    spec = SandboxSpec(image=base_image)
    sb, _ = await pool.acquire(spec)
    first_id = sb.id
    # the previous rollout leaves markers everywhere writable, background processes (one escaped with setsid),
    # shell history and an exported variable behind
    r = await sb.exec(["bash", "-c", MARKERS + "; echo 'echo leaked' > /tmp/.bash_history; export LEAK=1"])
    assert r.exit_code == 0, r.stderr
    await sb.exec("nohup sleep 1000 >/dev/null 2>&1 &")
    stream = sb.exec_stream("setsid sleep 1001 & sleep 1002", timeout=100)
    async for _ in stream:
        break
    assert await pool.release(sb, recycle=True)
    again, source = await pool.acquire(spec)
    assert source == "warm" and again.id == first_id
    ps = await again.exec(["ps", "-eo", "pid,args"])
    assert b"sleep 100" not in ps.stdout, ps.stdout.decode()
    listing = await again.exec("ls -A /tmp /workspace /dev/shm /run/envd")
    assert b"marker" not in listing.stdout and b"sub" not in listing.stdout and b".bash_history" not in listing.stdout
    assert b"envd.sock" in listing.stdout  # envd itself is untouched
    env = await again.exec("env")
    assert b"LEAK" not in env.stdout
    await pool.release(again, recycle=False)
    await stream.aclose()  # type: ignore[attr-defined]


async def test_a_recycling_pool_creates_nothing_while_its_sandboxes_come_back(
    pool_factory: Callable[..., SandboxPool],
    base_image: str,
    backend: DockerBackend,
    docker_client: docker.DockerClient,
) -> None:
    pool: SandboxPool = pool_factory(max_idle_per_pool=8, max_idle_total=8)
    spec = SandboxSpec(image=base_image)
    for sb, _ in await asyncio.gather(*(pool.acquire(spec) for _ in range(4))):
        assert await pool.release(sb, recycle=True)
    await asyncio.sleep(1.5)  # during the cold acquires the refiller may rightly have added one
    fleet = _ids(docker_client, backend.owner.instance)
    assert pool.idle_total == len(fleet) >= 4
    for _ in range(3):  # the whole fleet busy at once: the refiller must count it as on its way back
        held = await asyncio.gather(*(pool.acquire(spec) for _ in fleet))
        assert {source for _, source in held} == {"warm"}
        await asyncio.sleep(1.5)  # the refiller wakes at least once a second
        for sb, _ in held:
            assert await pool.release(sb, recycle=True)
    assert _ids(docker_client, backend.owner.instance) == fleet  # nothing created (or destroyed) in between


async def test_releases_that_overlap_keep_no_more_than_the_pool_holds() -> None:
    # each release checks for room before its reset and joins the idle after it: releases overlapping during their
    # resets each saw the room for one and all were kept (two workers' pools of one kept three between them)
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake.backend import FakeBackend

    backend = FakeBackend(FakeBackendConfig(owner="pool-overlap", reset_latency_s=0.2))
    pool = SandboxPool(backend, PoolConfig(max_idle_total=2, max_idle_per_pool=1))  # not started: no refill
    spec = SandboxSpec(image=backend.config.base_image)
    other = SandboxSpec(image=backend.config.base_image, env={"POOL": "other"})
    try:
        held = await asyncio.gather(*(pool.acquire(s) for s in [spec] * 4 + [other] * 4))
        recycled = await asyncio.gather(*(pool.release(sb, recycle=True) for sb, _ in held))
        assert recycled.count(True) == 2 and pool.idle_total == 2, recycled  # one a pool, two in all
        assert _discards(pool, "no_room") == 6
    finally:
        await pool.close()


def _fake(**kw: float) -> tuple[FakeBackend, SandboxSpec]:
    backend = FakeBackend(FakeBackendConfig(owner="pool-races", **kw))  # type: ignore[arg-type]
    return backend, SandboxSpec(image=backend.config.base_image)


async def test_refills_that_land_after_releases_were_kept_keep_no_more_than_the_pool_holds() -> None:
    # two cold acquires read as demand: the refiller creates two; meanwhile both sandboxes come back and are kept.
    # The refills, landing on a full pool, are destroyed rather than kept past max_idle_per_pool
    backend, spec = _fake(create_latency_s=0.3)
    pool = SandboxPool(backend, PoolConfig(max_idle_per_pool=2, min_idle_per_pool=2, freeze_idle_after_s=0))
    pool.start()
    try:
        held = await asyncio.gather(*(pool.acquire(spec) for _ in range(2)))
        await _until(lambda: sum(p.creating for p in pool._pools.values()) > 0)
        assert all(await asyncio.gather(*(pool.release(sb, recycle=True) for sb, _ in held)))
        await _until(lambda: not any(p.creating or p.queued for p in pool._pools.values()))
        await asyncio.sleep(0.1)
        assert pool.idle_total == 2 and _discards(pool, "no_room") >= 1
    finally:
        await pool.close()
        await backend.close()


async def test_an_acquire_cancelled_during_its_health_check_gives_the_sandbox_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a rollout's timeout or a cancelled job can end an acquire while it probes an idle sandbox: the sandbox was
    # neither idle nor handed out, and nobody would ever release it (nor the pool's busy count)
    from orchestrator.backends.fake.machine import FakeMachine

    async def slow(self: FakeMachine, timeout: float) -> bool:
        await asyncio.sleep(5)
        return True

    backend, spec = _fake()
    pool = SandboxPool(backend, PoolConfig(probe_idle_after_s=0))
    try:
        sb, _ = await pool.acquire(spec)
        assert await pool.release(sb, recycle=True)
        monkeypatch.setattr(FakeMachine, "health", slow)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await pool.acquire(spec)
        assert (pool.idle_total, pool.busy, sum(p.busy for p in pool._pools.values())) == (1, 0, 0)
        monkeypatch.undo()
        again, source = await pool.acquire(spec)
        assert (again.id, source) == (sb.id, "warm")
    finally:
        await pool.close()
        await backend.close()


async def test_a_pool_closing_destroys_what_it_was_destroying_and_what_comes_back_after() -> None:
    # close() cancelled its own destroys midway (a removal cancelled after the sandbox marked itself closed was
    # never made), and a release whose reset outlived close() was put back into the closed pool
    backend, spec = _fake(destroy_latency_s=0.3, reset_latency_s=0.5)
    pool = SandboxPool(backend, PoolConfig())
    try:
        (a, _), (b, _) = await asyncio.gather(pool.acquire(spec), pool.acquire(spec))
        assert await pool.release(a, recycle=True)
        pool._destroy_later(pool._pop_oldest(next(iter(pool._pools.values()))), "expired")  # a: being destroyed
        resetting = asyncio.create_task(pool.release(b, recycle=True))
        await asyncio.sleep(0.1)  # b: in its reset
        await pool.close()
        assert not await resetting and pool.idle_total == 0
        assert _discards(pool, "reset_failed") == 0  # its reset did not fail
        c, _ = await pool.acquire(spec)
        assert not await pool.release(c, recycle=True)  # after close: destroyed
        assert await backend.list_owned() == []
    finally:
        await backend.close()


async def test_a_sandbox_whose_lease_ends_soon_is_neither_recycled_nor_handed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the backend's sweep removes a sandbox at the end of its lease, in use or not: a recycled sandbox's lease runs
    # from its creation, so a rollout handed one about to end would lose it midway (an infrastructure retry)
    backend, spec = _fake()
    pool = SandboxPool(backend, PoolConfig())
    lease = {"left": 3600.0}
    monkeypatch.setattr(FakeSandbox, "lease_left_s", lambda self: lease["left"])
    try:
        sb, _ = await pool.acquire(spec)
        assert await pool.release(sb, recycle=True)
        lease["left"] = 500.0
        again, source = await pool.acquire(spec, need_s=600)  # a rollout of up to 600 s: not this one
        assert source == "cold" and again.id != sb.id and _discards(pool, "expired") == 1
        lease["left"] = 30.0
        assert not await pool.release(again, recycle=True)
    finally:
        await pool.close()
        await backend.close()


async def test_a_cancelled_rollouts_sandbox_leaves_the_pools_busy_count() -> None:
    # a cancelled rollout (CancelJob, a worker's stream ending) destroys its sandbox at once: closed behind the
    # pool's back, it stayed busy in the count for good, and a worker's pool stopped refilling once its slots'
    # worth had been cancelled (the refill never goes past max_sandboxes held)
    from environments.python_tool import PythonToolEnv
    from orchestrator.core.models import JobSpec, TaskSelection
    from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
    from orchestrator.rollout.runner import RolloutRunner, WorkItem
    from orchestrator.service.executor import LocalExecutor

    backend, _ = _fake(exec_latency_s=1.0)
    pool = SandboxPool(backend, PoolConfig(), max_sandboxes=2)
    executor = LocalExecutor(RolloutRunner(pool, backend.images))
    env = PythonToolEnv()
    spec = JobSpec(env=env.ref(), tasks=TaskSelection(kind="all"), policy=PolicyEndpoint(base_url=REPLAY_URL))
    try:
        runs = [
            asyncio.create_task(executor.run(WorkItem("j", t, 0, time.monotonic()), env, spec)) for t in env.tasks()[:2]
        ]
        await _until(lambda: pool.busy == 2)
        await asyncio.sleep(0.2)  # in their first exec
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        assert (pool.busy, sum(p.busy for p in pool._pools.values())) == (0, 0)
        assert await backend.list_owned() == []  # and destroyed by then
    finally:
        await pool.close()
        await backend.close()


@pytest.mark.parametrize("timeout_s", [600.0, 7200.0])
async def test_a_rollouts_sandbox_has_a_lease_that_outlasts_its_attempt(timeout_s: float) -> None:
    # the runner asks the pool for a sandbox it may hold for the attempt's whole time (the fleet's part, the
    # episode's, the grader's), and a cold one's lease covers it: with the default lease of an hour, a two-hour
    # rollout was swept midway
    from environments.python_tool import PythonToolEnv
    from orchestrator.core.environment import scoring_budget
    from orchestrator.core.models import JobSpec, TaskSelection
    from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
    from orchestrator.rollout.runner import RolloutRunner, WorkItem, attempt_s
    from orchestrator.service.executor import LocalExecutor

    backend, _ = _fake()
    pool = SandboxPool(backend, PoolConfig())
    asked: list[tuple[float, float]] = []
    acquire = pool.acquire

    async def recorded(spec: SandboxSpec, *, need_s: float = 0.0) -> tuple[Sandbox, str]:
        asked.append((spec.ttl_s, need_s))
        return await acquire(spec, need_s=need_s)

    pool.acquire = recorded  # type: ignore[method-assign]
    env = PythonToolEnv()
    spec = JobSpec(
        env=env.ref(),
        tasks=TaskSelection(kind="all"),
        policy=PolicyEndpoint(base_url=REPLAY_URL),
        rollout_timeout_s=timeout_s,
    )
    try:
        await LocalExecutor(RolloutRunner(pool, backend.images)).run(WorkItem("j", env.tasks()[0], 0, 0.0), env, spec)
        [(ttl, need)] = asked
        assert need == 2 * timeout_s + scoring_budget(env, env.tasks()[0]) and ttl >= max(3600.0, need + 60)
        # a policy server's job holds it for the wait its server down may take too, which moves the attempt's end on
        served = spec.model_copy(update={"policy": PolicyEndpoint(base_url="http://127.0.0.1:9/v1")})
        assert attempt_s(served, 0.0) == attempt_s(spec, 0.0) + served.policy.outage_wait_s
    finally:
        await pool.close()
        await backend.close()


async def test_a_full_pool_does_not_churn_destroying_releases_and_creating_their_replacements() -> None:
    # the pool's bookkeeping on the fake backend (no Docker needed). A ramp-up left more sandboxes than the pool
    # keeps, so some releases found no room and were destroyed. Those releases still came back: counted as "not
    # recycling", the pool had taken every acquire for unmet demand and created a replacement for each, to destroy
    # one at the next release, a create and a destroy per rollout for as long as the job ran (on a 2-core host
    # that churn was most of the CPU at steady state)
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake.backend import FakeBackend

    backend = FakeBackend(FakeBackendConfig(owner="pool-churn", create_latency_s=2.0))
    pool = SandboxPool(backend, PoolConfig(max_idle_total=4, max_idle_per_pool=4))
    pool.start()
    spec = SandboxSpec(image=backend.config.base_image)
    try:
        ramp = await asyncio.gather(*(pool.acquire(spec) for _ in range(8)))
        recycled = [await pool.release(sb, recycle=True) for sb, _ in ramp]
        assert recycled.count(True) == 4, "four fit, four found no room"
        assert _discards(pool, "no_room") == 4
        await asyncio.sleep(2.5)  # what the refiller began during the ramp is done
        created = backend.created
        for _ in range(8):  # the job at steady state: four rollouts at a time, each sandbox back after its rollout
            held = await asyncio.gather(*(pool.acquire(spec) for _ in range(4)))
            await asyncio.sleep(0.4)
            for sb, _ in held:
                await pool.release(sb, recycle=True)
        await asyncio.sleep(1.2)  # the refiller wakes at least once a second
        assert backend.created == created, f"{backend.created - created} sandbox(es) created that no acquire needed"
    finally:
        await pool.close()
        await backend.close()


async def test_a_sandbox_just_reset_is_handed_out_without_another_health_check(
    pool_factory: Callable[..., SandboxPool], base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a reset has just proven envd alive: a second call to ask again would be one more envd call per rollout
    pool: SandboxPool = pool_factory(max_sandboxes=1)
    spec = SandboxSpec(image=base_image)
    sb, _ = await pool.acquire(spec)
    assert await pool.release(sb, recycle=True)
    probes: list[object] = []
    health = type(sb.transport).health  # type: ignore[attr-defined]

    async def counted(self: object, *a: object, **kw: object) -> object:
        probes.append(self)
        return await health(self, *a, **kw)

    monkeypatch.setattr(type(sb.transport), "health", counted)  # type: ignore[attr-defined]
    again, source = await pool.acquire(spec)
    assert (source, again.id, probes) == ("warm", sb.id, [])
    await pool.release(again, recycle=False)


async def _killed_while_idle(pool: SandboxPool, spec: SandboxSpec, docker_client: docker.DockerClient) -> str:
    """A sandbox recycled into the pool, then its container killed behind the pool's back; its id."""
    sb, _ = await pool.acquire(spec)
    assert await pool.release(sb, recycle=True)
    docker_client.containers.get(sb.id).kill()
    return sb.id


async def test_a_sandbox_that_died_while_idle_is_never_handed_out_after_the_probe_window(
    pool_factory: Callable[..., SandboxPool], base_image: str, docker_client: docker.DockerClient
) -> None:
    pool: SandboxPool = pool_factory(probe_idle_after_s=0, max_sandboxes=1)
    spec = SandboxSpec(image=base_image)
    killed = await _killed_while_idle(pool, spec, docker_client)
    again, source = await pool.acquire(spec)
    assert again.id != killed and source == "cold"
    assert _discards(pool, "probe") == 1  # the one reason a sandbox left the pool, and it says so
    assert _probes(pool, "gone") == 1
    assert (await again.exec(["echo", "hi"])).stdout == b"hi\n"
    await pool.release(again, recycle=False)


async def test_a_sandbox_too_slow_to_answer_the_probe_is_handed_out_not_destroyed(
    pool_factory: Callable[..., SandboxPool], base_image: str, docker_client: docker.DockerClient
) -> None:
    # on a loaded host an idle envd can take longer than the probe's timeout to answer: destroying it, and starting
    # another, is what a loaded host can least afford. One that refuses is gone (the test above)
    pool: SandboxPool = pool_factory(probe_idle_after_s=0, probe_timeout_s=0.5, max_sandboxes=1)
    spec = SandboxSpec(image=base_image)
    sb, _ = await pool.acquire(spec)
    assert await pool.release(sb, recycle=True)
    envd = envd_pid(docker_client.api, sb.id)
    os.kill(envd, signal.SIGSTOP)  # there, and not answering
    try:
        again, source = await pool.acquire(spec)
    finally:
        os.kill(envd, signal.SIGCONT)
    assert (again.id, source) == (sb.id, "warm")
    assert (_probes(pool, "slow"), _discards(pool, "probe")) == (1, 0)
    assert (await again.exec(["echo", "hi"])).stdout == b"hi\n"
    await pool.release(again, recycle=False)


async def test_a_sandbox_that_died_inside_the_probe_window_fails_as_the_sandbox_not_as_a_result(
    pool_factory: Callable[..., SandboxPool], base_image: str, docker_client: docker.DockerClient
) -> None:
    # the price of skipping the probe: the rollout's first call finds the sandbox gone, as a SandboxError (an
    # infrastructure retry), never as a command that ran
    pool: SandboxPool = pool_factory(probe_idle_after_s=60, max_sandboxes=1)
    spec = SandboxSpec(image=base_image)
    killed = await _killed_while_idle(pool, spec, docker_client)
    again, source = await pool.acquire(spec)
    assert (again.id, source) == (killed, "warm")
    with pytest.raises(SandboxError):
        await again.exec(["echo", "hi"])
    await pool.release(again, recycle=False)


async def test_the_most_recently_returned_sandbox_is_handed_out_first() -> None:
    # LIFO on the fake backend: the sandboxes a steady job needs stay hot, and the surplus stays idle until its
    # TTL retires it (handed out in turn, every idle sandbox would look in use and none would ever expire)
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake.backend import FakeBackend

    backend = FakeBackend(FakeBackendConfig(owner="pool-lifo"))
    pool = SandboxPool(backend, PoolConfig(max_idle_total=8, max_idle_per_pool=8, idle_ttl_s=1.5))
    pool.start()
    spec = SandboxSpec(image=backend.config.base_image)
    try:
        held = [sb for sb, _ in await asyncio.gather(*(pool.acquire(spec) for _ in range(4)))]
        for sb in held:
            assert await pool.release(sb, recycle=True)
        hot = held[-1]
        for _ in range(6):  # one rollout at a time, for longer than the TTL
            sb, source = await pool.acquire(spec)
            assert (sb.id, source) == (hot.id, "warm")
            await asyncio.sleep(0.4)
            assert await pool.release(sb, recycle=True)
        await _until(lambda: pool.idle_total == 1, timeout=5)  # the ones it never needed have expired
        assert _discards(pool, "expired") == backend.created - 1  # every one but the hot one, the metric says
    finally:
        await pool.close()
        await backend.close()


async def test_a_job_ramping_up_cold_never_has_more_sandboxes_than_its_worker_can_use() -> None:
    # a job starts on an empty pool at the worker's full concurrency: every acquire is cold, which reads as demand
    # until the rollouts come back, and on a loaded host a create takes seconds. The refiller then queued dozens
    # of creates on top of the rollouts' own; in the full scale bench a worker of 500 slots reached 550 sandboxes
    # with the host's memory at 90%. A pool never holds more than its owner can use at once
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake.backend import FakeBackend

    backend = FakeBackend(FakeBackendConfig(owner="pool-ramp", create_latency_s=1.0, reset_latency_s=0.3))
    pool = SandboxPool(backend, PoolConfig(max_idle_total=64, max_idle_per_pool=64, rate_window_s=2.0), max_sandboxes=8)
    pool.start()
    spec = SandboxSpec(image=backend.config.base_image)
    pool._pool(spec).start_latency_s = 5.0  # what cold starts take on a loaded host (the pool's own estimate)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(await backend.list_owned()))
            await asyncio.sleep(0.02)

    stop = time.monotonic() + 4

    async def rollouts() -> None:  # take a sandbox, use it, recycle it, again
        while time.monotonic() < stop:
            sb, _ = await pool.acquire(spec)
            await asyncio.sleep(0.3)
            assert await pool.release(sb, recycle=True)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(rollouts() for _ in range(8)))  # the worker's 8 slots, all at once
        await asyncio.sleep(1.2)  # the refiller wakes at least once a second
        assert (peak, backend.created) == (8, 8)
    finally:
        watcher.cancel()
        await pool.close()
        await backend.close()


async def test_a_job_on_a_warm_pool_creates_nothing() -> None:
    # the job starts on a warm pool: every acquire finds a sandbox idle, every release is recycled, and a loaded
    # host takes a while per reset. The refiller took acquires less recycles for unmet demand, but recycles lag
    # acquires by a rollout's length, so the start of every job read as demand; and a sandbox being reset was
    # neither busy nor idle, so it read as missing. At 128 concurrent rollouts on 2 cores that was 0.52 cold
    # creates per rollout, each a container, a shim and an envd started: about half of the CPU each rollout cost
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake.backend import FakeBackend

    backend = FakeBackend(FakeBackendConfig(owner="pool-warm-job", create_latency_s=1.0, reset_latency_s=0.6))
    pool = SandboxPool(backend, PoolConfig(max_idle_total=64, max_idle_per_pool=64, rate_window_s=2.0))
    pool.start()
    spec = SandboxSpec(image=backend.config.base_image)
    try:
        for sb in await asyncio.gather(*(backend.create(pool._pool(spec).spec) for _ in range(8))):
            assert await pool.release(sb, recycle=True)  # a warm fleet of 8, as the last job left it
        pool._pool(spec).start_latency_s = 5.0  # what cold starts take on a loaded host (the pool's own estimate)
        created = backend.created
        stop = time.monotonic() + 4
        sources: list[str] = []

        async def rollouts() -> None:  # take a sandbox, use it, recycle it, again
            while time.monotonic() < stop:
                sb, source = await pool.acquire(spec)
                sources.append(source)
                await asyncio.sleep(0.3)
                assert await pool.release(sb, recycle=True)

        await asyncio.gather(*(rollouts() for _ in range(8)))  # the whole fleet: in use, in reset, or idle
        assert set(sources) == {"warm"}
        await asyncio.sleep(1.2)  # the refiller wakes at least once a second
        assert backend.created == created, f"{backend.created - created} sandbox(es) created that no acquire needed"
    finally:
        await pool.close()
        await backend.close()


async def test_the_refiller_never_queues_the_same_shortfall_twice() -> None:
    # the refiller wakes at every acquire and creates a few at a time (refill_concurrency). Refills waiting for
    # their turn were not counted, so each wake queued the whole shortfall again: thousands of creates queued for
    # a shortfall of a few, made long after anything needed them
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake.backend import FakeBackend

    backend = FakeBackend(FakeBackendConfig(owner="pool-queued", create_latency_s=0.3))
    pool = SandboxPool(
        backend, PoolConfig(max_idle_total=64, max_idle_per_pool=64, min_idle_per_pool=6, refill_concurrency=1)
    )
    spec = SandboxSpec(image=backend.config.base_image)
    pool.warm(spec)
    pool.start()
    try:
        for _ in range(20):  # wakes meanwhile, as acquires do
            pool.warm(spec)
            await asyncio.sleep(0.05)
        await _until(lambda: pool.idle_total >= 6, timeout=10)
        await asyncio.sleep(1.5)
        assert backend.created == 6, f"{backend.created} created for a minimum of 6 idle"
    finally:
        await pool.close()
        await backend.close()


async def test_idle_sandboxes_are_frozen_a_batch_a_second_not_all_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # each freeze is a write on the pool's loop: a thousand at once would stall the worker, heartbeats included
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.backends.fake import FakeBackend, FakeSandbox
    from orchestrator.backends.pool import FREEZES_PER_TICK

    frozen: list[float] = []

    def freeze(self: FakeSandbox) -> bool:
        frozen.append(time.monotonic())
        return True

    monkeypatch.setattr(FakeSandbox, "freeze", freeze)
    n = FREEZES_PER_TICK * 2 + 8
    backend = FakeBackend(FakeBackendConfig(owner="pool-freeze"))
    # room for the refiller's own creates too (the cold acquires read as demand): every release is kept
    pool = SandboxPool(backend, PoolConfig(max_idle_total=2 * n, max_idle_per_pool=2 * n, freeze_idle_after_s=0.1))
    pool.start()
    spec = SandboxSpec(image=backend.config.base_image)
    try:
        held = [sb for sb, _ in await asyncio.gather(*(pool.acquire(spec) for _ in range(n)))]
        for sb in held:
            assert await pool.release(sb, recycle=True)
        await _until(lambda: len(frozen) >= n and len(frozen) == pool.idle_total, timeout=10)
        assert pool.metrics.registry.get_sample_value("envfleet_pool_frozen") == len(frozen)
        bursts = [1]  # freezes one refill tick made: the next tick is a second or more later
        for a, b in itertools.pairwise(frozen):
            if b - a > 0.5:
                bursts.append(0)
            bursts[-1] += 1
        assert len(bursts) >= 3 and max(bursts) == FREEZES_PER_TICK, bursts
    finally:
        await pool.close()
        await backend.close()


async def test_a_reset_that_raises_destroys_the_sandbox() -> None:
    # a reset that raised (rather than saying it failed) left the sandbox neither kept nor destroyed: on docker its
    # container ran until its lease ended, an hour or more, with nothing counting it
    backend, spec = _fake()
    pool = SandboxPool(backend, PoolConfig(max_idle_per_pool=2))  # not started: no refill
    try:
        sandbox, _ = await pool.acquire(spec)

        async def broken(workspace_seed: str = "") -> ResetOutcome:
            raise RuntimeError("the transport broke")

        sandbox.reset = broken  # type: ignore[method-assign]
        assert await pool.release(sandbox, recycle=True) is False
        await _until(lambda: sandbox.id not in backend._owned, 5)  # type: ignore[attr-defined]
        p = pool._pools[pool_key(spec)]
        assert pool.idle_total == 0 and p.resetting == 0 and p.busy == 0
        assert _discards(pool, "reset_failed") == 1
    finally:
        await pool.close()


async def test_a_sandbox_reset_to_one_seed_is_no_warm_sandbox_of_another() -> None:
    # the pool key left out the workspace seed a release resets to: two environments on one image, the second
    # without a seed, shared a pool, and the second's rollout got a workspace restored from the first's seed
    backend, spec = _fake()
    seeded = spec.model_copy(update={"labels": pool_labels("team-a", "/seed/a")})
    plain = spec.model_copy(update={"labels": pool_labels("team-a")})
    assert pool_key(seeded) != pool_key(plain)
    assert pool_key(seeded) == pool_key(spec.model_copy(update={"labels": pool_labels("team-a", "/seed/a")}))
    pool = SandboxPool(backend, PoolConfig(max_idle_per_pool=2))
    try:
        a, _ = await pool.acquire(seeded)
        assert await pool.release(a, recycle=True)  # kept warm, reset to its seed
        b, source = await pool.acquire(plain)
        assert source == "cold" and b is not a
        again, source = await pool.acquire(seeded)
        assert source == "warm" and again is a
        for s in (b, again):
            await pool.release(s, recycle=False)
    finally:
        await pool.close()


async def test_the_busy_and_idle_gauges_are_what_the_pool_holds_when_read() -> None:
    # set only at some of the pool's events: after a cold acquire, a release, or with the pool off, the busy gauge
    # said what it had been
    backend, spec = _fake()
    pool = SandboxPool(backend, PoolConfig(enabled=False))

    def gauge(state: str) -> float | None:
        return pool.metrics.registry.get_sample_value("envfleet_sandboxes", {"state": state})

    try:
        held = [await pool.acquire(spec) for _ in range(3)]
        assert gauge("busy") == 3 and gauge("idle") == 0
        await pool.release(held[0][0], recycle=False)
        assert gauge("busy") == 2
    finally:
        for sandbox, _ in held[1:]:
            await pool.release(sandbox, recycle=False)
        await pool.close()


async def test_a_pool_out_of_use_keeps_no_minimum_and_is_forgotten() -> None:
    # min_idle_per_pool held for every pool ever made: one tenant's one job, with an image of its own, left that
    # many sandboxes refilled past each TTL for good. A declared (warm) pool keeps its minimum
    backend, spec = _fake()
    declared = SandboxSpec(image=backend.config.base_image, ttl_s=7200)  # another pool key
    config = PoolConfig(min_idle_per_pool=2, max_idle_per_pool=4, idle_ttl_s=0.5, rate_window_s=0.5)
    pool = SandboxPool(backend, config)
    pool.start()
    try:
        pool.warm(declared)
        sb, _ = await pool.acquire(spec)
        await pool.release(sb, recycle=True)
        await _until(lambda: pool_key(spec) not in pool._pools, timeout=10)
        await asyncio.sleep(1.5)  # past the TTL again: nothing refilled it
        assert pool_key(spec) not in pool._pools
        await _until(lambda: len(pool._pools[pool_key(declared)].idle) == 2)  # refilled past each TTL
    finally:
        await pool.close()
        await backend.close()


async def test_a_pool_in_use_for_long_keeps_only_its_windows_acquires() -> None:
    # the acquire times were forgotten only while the pool was empty (the refiller's `_unused` reads its rate then):
    # a pool recycling through a long run kept a float for every rollout, hundreds of MB a day on a busy worker
    backend, spec = _fake()
    pool = SandboxPool(backend, PoolConfig(rate_window_s=0.2))
    pool.start()
    try:
        t0, n = time.monotonic(), 0
        while time.monotonic() - t0 < 1.0:
            sb, _ = await pool.acquire(spec)
            await pool.release(sb, recycle=True)
            n += 1
            await asyncio.sleep(0.005)
        p = pool._pools[pool_key(spec)]
        assert p.idle, "the pool was in use throughout"
        assert n > 50 and len(p.acquires) < n / 2, (n, len(p.acquires))
        assert all(t >= time.monotonic() - 0.3 for t in p.acquires)
    finally:
        await pool.close()
        await backend.close()


async def test_a_disabled_pool_forgets_each_spec_once_its_sandboxes_are_back() -> None:
    # without a refiller nothing forgot a pool: one for every spec ever named (a tenant's image, limits and lease)
    backend, _ = _fake()
    pool = SandboxPool(backend, PoolConfig(enabled=False))
    pool.start()
    try:
        specs = [SandboxSpec(image=backend.config.base_image, env={"N": str(i)}) for i in range(20)]
        held = await asyncio.gather(*(pool.acquire(s) for s in specs))
        assert len(pool._pools) == 20
        for sb, _ in held:
            assert not await pool.release(sb, recycle=True)  # never kept: the pool is off
        assert pool._pools == {}
        sb, _ = await pool.acquire(specs[0])  # and a spec named again is a pool again
        assert len(pool._pools) == 1
        await pool.close_now(sb)
        assert pool._pools == {}
        # nor does a create that fails keep one
        with pytest.raises(SandboxError):
            await pool.acquire(SandboxSpec(image="envfleet/no-such-image:1"))
        assert pool._pools == {}
    finally:
        await pool.close()
        await backend.close()
