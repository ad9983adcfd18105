"""Fleet benchmarks: warm acquire, recycling, the orchestrator with recycling, and group snapshots.

Each figure is measured side by side with its baseline in the same run, as a ratio.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import docker

from bench.orchestrator_bench import TrivialEnv, baseline_rollouts_per_s, bench_orchestrator
from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
from orchestrator.backends.pool import PoolConfig, SandboxPool
from orchestrator.core.environment import Environment, Rubric, ScoringContext, Task, ToolInvocation
from orchestrator.core.models import JobSpec, RolloutStatus, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.core.sandbox import Sandbox, SandboxSpec

OWNER = "envfleet-bench"


def _p50_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 3)


def _pair(ours: list[float], base: list[float]) -> dict[str, Any]:
    e, b = _p50_ms(ours), _p50_ms(base)
    return {"envfleet_p50_ms": e, "baseline_p50_ms": b, "ratio": round(e / b, 4), "runs": len(ours)}


async def warm_and_recycle(image: str, runs: int = 20) -> dict[str, Any]:
    """`warm_acquire` (pool acquire vs SDK docker run --rm) and `recycle_vs_create` (reset vs destroy + create)."""
    client = docker.from_env()
    backend = await DockerBackend.start(DockerBackendConfig(owner=OWNER))
    pool = SandboxPool(backend, PoolConfig(min_idle_per_pool=4, max_idle_per_pool=8))
    pool.start()
    spec = SandboxSpec(image=image)
    try:
        pool.warm(spec)
        for _ in range(1200):  # the refiller fills the pool in the background
            if pool.idle_total >= 4:
                break
            await asyncio.sleep(0.05)
        acquire: list[float] = []
        run_rm: list[float] = []
        reset: list[float] = []
        recreate: list[float] = []
        for _ in range(runs):
            t0 = time.perf_counter()
            sb, source = await pool.acquire(spec)
            acquire.append(time.perf_counter() - t0)
            assert source == "warm"
            await sb.exec("echo dirty > /workspace/x; sleep 100 &")
            t0 = time.perf_counter()
            outcome = await sb.reset()
            reset.append(time.perf_counter() - t0)
            assert outcome.ok, outcome.detail
            await pool.release(sb, recycle=True)
            t0 = time.perf_counter()
            await asyncio.to_thread(client.containers.run, image, ["true"], remove=True, network_mode="none")
            run_rm.append(time.perf_counter() - t0)
            fresh = await backend.create(spec)
            t0 = time.perf_counter()
            await fresh.close()
            again = await backend.create(spec)
            recreate.append(time.perf_counter() - t0)
            await again.close()
        return {"warm_acquire": _pair(acquire, run_rm), "recycle_vs_create": _pair(reset, recreate)}
    finally:
        await pool.close()
        await backend.close()


class RecycledTrivialEnv(TrivialEnv):
    """The orchestrator_overhead episode, with reusable sandboxes."""

    name = "bench-trivial-recycled"
    reusable = True


async def orchestrator_overhead_recycled(image: str, total: int = 200, concurrency: int = 8) -> dict[str, Any]:
    """Rollouts/s with warm pools and recycling against the same plain docker SDK loop (run, exec_run, remove)."""
    env = RecycledTrivialEnv(total + 1)
    async with bench_orchestrator(env, concurrency, OWNER) as (client, url):
        spec = JobSpec(env=env.name, policy=PolicyEndpoint(base_url=url), max_concurrency=concurrency)
        ids = [t.id for t in env.tasks()]
        warm = await client.submit(spec.model_copy(update={"tasks": TaskSelection(kind="ids", ids=ids[:concurrency])}))
        [r async for r in client.rollouts(warm)]  # the pool fills as the first rollouts finish
        t0 = time.perf_counter()
        job = await client.submit(
            spec.model_copy(update={"tasks": TaskSelection(kind="ids", ids=ids[concurrency : concurrency + total])})
        )
        got = [r async for r in client.rollouts(job)]
        ours = len(got) / (time.perf_counter() - t0)
    bad = [r for r in got if r.status != RolloutStatus.OK or r.reward != 1.0]
    if bad:
        raise RuntimeError(f"{len(bad)} bad rollouts, e.g. {bad[0].error}")
    warm_share = sum(r.metrics.get("sandbox_warm", 0.0) for r in got) / len(got)
    base = await asyncio.to_thread(baseline_rollouts_per_s, image, 48, concurrency)
    return {
        "envfleet_rollouts_per_s": round(ours, 2),
        "baseline_rollouts_per_s": round(base, 3),
        "ratio": round(ours / base, 2),
        "rollouts": total,
        "concurrency": concurrency,
        "warm_share": round(warm_share, 3),
    }


SETUP_CPU = "python3 -c 'import time\nt = time.process_time()\nwhile time.process_time() - t < 10: pass'"


async def _ready(ctx: ScoringContext) -> float:
    return float((await ctx.sandbox.read_file("deps/ready")) == b"ok\n")


class HeavySetupEnv(Environment):
    """A task whose setup costs about 10 s of CPU (think: building the task's dependencies)."""

    name = "bench-heavy-setup"
    tools = ("submit",)
    snapshot_setup = True
    rubric = Rubric([("ready", _ready, 1.0)])

    def tasks(self) -> Sequence[Task]:
        return [Task(id="heavy", prompt="submit", reference=(ToolInvocation("submit", {"answer": "x"}),))]

    async def setup(self, sandbox: Sandbox, task: Task, seed: int) -> None:
        r = await sandbox.exec(f"{SETUP_CPU} && mkdir -p deps && echo ok > deps/ready", timeout=300)
        assert r.exit_code == 0, r.stderr


class HeavySetupNoSnapshotEnv(HeavySetupEnv):
    name = "bench-heavy-setup-independent"
    snapshot_setup = False


async def group_snapshot(n: int = 8) -> dict[str, Any]:
    """Seconds until all n samples of a group are set up and scored: from one snapshot vs n independent setups."""
    results: dict[str, float] = {}
    for env in (HeavySetupEnv(), HeavySetupNoSnapshotEnv()):
        async with bench_orchestrator(env, n, OWNER) as (client, url):
            spec = JobSpec(env=env.name, group_size=n, policy=PolicyEndpoint(base_url=url), max_concurrency=n)
            t0 = time.perf_counter()
            got = [r async for r in client.rollouts(await client.submit(spec))]
            results[env.name] = time.perf_counter() - t0
        assert all(r.reward == 1.0 for r in got), [r.error for r in got]
    ours, base = results[HeavySetupEnv.name], results[HeavySetupNoSnapshotEnv.name]
    return {"envfleet_s": round(ours, 2), "baseline_s": round(base, 2), "ratio": round(ours / base, 3), "n": n}
