"""`make bench-scale`: hold many sandboxes at once on this host and push light rollouts through them.

Phases (all in one run, results under `scale` in bench/results.json):
1. warm N sandboxes (each with its envd) through the pool; the host's used memory at peak minus before, per sandbox.
   Growth stops early, and says so, if the projection would pass 90% of the host's memory;
2. acquire latency with 64 concurrent acquires from the warm pool (p50, p99); then the host's CPU while the same
   sandboxes sit idle in the pool past freeze_idle_after_s (frozen), beside their CPU idle and not frozen;
3. R rollouts (3 turns, the scripted policy answering after a simulated 1 s, one short exec per turn) with all the
   sandboxes in flight, recycled between rollouts;
4. efficiency at 256 concurrent rollouts: measured rollouts per minute over the ideal (concurrency / episode time),
   every policy answer after exactly the latency, so that a wave's rollouts stay in step (`efficiency`); then the
   same with each answer's latency spread uniformly over latency x (1 +- SPREAD), the mean and so the ideal the same
   (`efficiency_spread`), as a model server's answers spread with their lengths;
5. leaked containers after shutdown.

With `--workers N` (the default, 2) phases 3 and 4 run on N rollout worker processes: the control plane's own
warm sandboxes of phases 1 and 2 are destroyed first, and the workers create and recycle their own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import docker
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench import proc_cpu
from bench.fleet_bench import timed_job
from orchestrator.backends.docker.backend import DockerBackendConfig
from orchestrator.backends.pool import TENANT_LABEL, PoolConfig
from orchestrator.core.environment import Environment, Rubric, ScoringContext, Task, ToolInvocation
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.core.runtime import tune_gc
from orchestrator.core.sandbox import DETERMINISTIC_ENV, Limits, Sandbox, SandboxSpec
from orchestrator.images import ensure_base_image
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.service.scheduler import Capacity
from orchestrator.service.tenancy import LOCAL_TENANT
from orchestrator.testing.policy_script import Script
from orchestrator.testing.scripts import reference_script
from orchestrator.worker.config import WorkerConfig

OWNER = "envfleet-scale"
SPREAD = 0.5  # phase 4b: policy answers after latency x (1 +- SPREAD), uniformly
log = logging.getLogger("scale")


def _ok(ctx: ScoringContext) -> float:
    return float(ctx.episode.answer == "ok")


class LightEnv(Environment):
    """Three turns: two short execs and a submit."""

    name = "scale-light"
    tools = ("bash", "submit")
    max_turns = 3
    reusable = True
    rubric = Rubric([("ok", _ok, 1.0)])
    limits = Limits(memory_mb=128, cpus=0.5, pids=64, tmp_mb=16, workspace_mb=16)

    def __init__(self, count: int = 10_000) -> None:
        self._tasks = tuple(
            Task(
                id=f"s{i:05d}",
                prompt="two commands then submit ok",
                reference=(
                    ToolInvocation("bash", {"command": "echo a"}),
                    ToolInvocation("bash", {"command": "echo b"}),
                    ToolInvocation("submit", {"answer": "ok"}),
                ),
            )
            for i in range(count)
        )

    def tasks(self) -> Sequence[Task]:
        return self._tasks


def used_memory_mb() -> float:
    """MemTotal - MemAvailable, in MB."""
    info = {
        k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    }
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def total_memory_mb() -> float:
    return int(Path("/proc/meminfo").read_text().split()[1]) / 1024


async def _start_policy(
    script_path: Path, latency: float, jitter: float = 0.0
) -> tuple[asyncio.subprocess.Process, str]:
    script = Script.model_validate_json(script_path.read_text())
    path = script_path.with_name(f"script-{latency:g}-{jitter:g}.json")
    path.write_text(script.model_copy(update={"latency_s": latency, "latency_jitter_s": jitter}).model_dump_json())
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchestrator.testing.scripted_policy",
        "--script",
        str(path),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode().split()
    return proc, line[1]


def pool_counts(orch: Orchestrator) -> dict[str, float]:
    """The warm pools' acquires by source and discards by reason, summed over the control plane and its workers
    (the workers' as their last heartbeat carried them)."""
    texts = [generate_latest(orch.metrics.registry)] if orch.metrics is not None else []
    if orch.workers is not None:
        texts += [text for _, _, text in orch.workers.hub.metric_snapshots()]
    counts: dict[str, float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                key = {
                    "envfleet_sandbox_acquire_seconds_count": f"acquires_{s.labels.get('source')}",
                    "envfleet_pool_discards_total": f"discards_{s.labels.get('reason')}",
                }.get(s.name)
                if key is not None:
                    counts[key] = counts.get(key, 0.0) + s.value
    return counts


def _steady_per_min(arrivals: list[float], concurrency: int) -> float:
    """Rollouts per minute from the `concurrency`-th arrival to the one `concurrency` before the last: the job's
    first rollouts (sandboxes and connections warming, every slot starting at once) and its last ones (slots
    emptying as the tasks run out) are not the fleet's rate at that concurrency, and with a few rollouts per slot
    they weigh on the whole job's figure; the ideal is a rate with every slot busy. 0 when the job is too short to
    have such a window."""
    times = sorted(arrivals)
    first, last = concurrency - 1, len(times) - concurrency - 1  # with waves in step: one wave's end to the next's
    if last <= first or times[last] <= times[first]:
        return 0.0
    return (last - first) / (times[last] - times[first]) * 60


async def _efficiency(
    orch: Orchestrator, job: JobSpec, ids: list[str], concurrency: int, latency: float
) -> dict[str, Any]:
    """Measured rollouts per minute over the ideal (concurrency / episode time) for `ids` at `concurrency`, with
    where the CPU went."""
    spec = job.model_copy(update={"max_concurrency": concurrency, "tasks": TaskSelection(kind="ids", ids=ids)})
    pool0 = pool_counts(orch)
    cpu0 = proc_cpu.read()
    arrivals: list[float] = []
    got, elapsed, _ = await timed_job(orch.address, spec, arrivals)
    cpu1 = proc_cpu.read()
    cpu = proc_cpu.per(cpu0, cpu1, sum(got.values()))
    if orch.workers is not None:  # the workers' figures come with their heartbeats
        await asyncio.sleep(WorkerConfig().metrics_s + 1)
    pool = {k: v - pool0.get(k, 0) for k, v in pool_counts(orch).items() if v - pool0.get(k, 0)}
    episode_s = 3 * latency
    ideal_per_min = concurrency / episode_s * 60
    measured = sum(got.values()) / elapsed * 60
    steady = _steady_per_min(arrivals, concurrency)
    return {
        "efficiency": round(measured / ideal_per_min, 3),
        "efficiency_concurrency": concurrency,
        "efficiency_detail": {
            "measured_per_min": round(measured, 1),
            "ideal_per_min": round(ideal_per_min, 1),
            # the rate while every slot was busy: the job's start and its last rollouts left out (below)
            "steady_per_min": round(steady, 1),
            "steady_efficiency": round(steady / ideal_per_min, 3),
            "ok": got["OK"],
            "rollouts": sum(got.values()),
            # where the CPU went: the ideal rate needs the host's cores / this total per rollout
            "cpu_ms_per_rollout": cpu,
            "cpu_ms_per_rollout_total": round(sum(cpu.values()), 1),
            # sandboxes destroyed (or started) meanwhile: an exited process's CPU is not in the figures above
            "processes_exited": proc_cpu.exited(cpu0, cpu1),
            # the warm pools meanwhile (all processes): acquires by source, sandboxes discarded by reason
            "pool": pool,
            "host_cpus": os.cpu_count(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 1),
        },
    }


async def run(
    sandboxes: int,
    rollouts: int,
    latency: float,
    eff_concurrency: int,
    eff_rollouts: int,
    workers: int,
    spread_rollouts: int = 2048,
    admission: bool = True,
) -> dict[str, Any]:
    client = docker.from_env()
    image = ensure_base_image(client)
    env = LightEnv()
    assert rollouts + eff_rollouts + spread_rollouts <= len(env.tasks())
    registry = Registry()
    result: dict[str, Any] = {"exec_admission": admission}
    with tempfile.TemporaryDirectory(prefix="envfleet-scale-") as data:
        script = reference_script(env, latency_s=latency)
        (Path(data) / "script.json").write_text(script.model_dump_json())
        policy_proc, policy_url = await _start_policy(Path(data) / "script.json", latency)
        mem_before = used_memory_mb()
        try:  # a server that fails to start leaves no policy process behind
            orch = await create_server(
                OrchestratorConfig(
                    port=0,
                    data_dir=Path(data),
                    max_in_flight=sandboxes,
                    # the default admission (CPU quotas up to 16x the cores) would cap these 0.5-CPU sandboxes at 64
                    # in flight; light rollouts mostly wait on the policy, so the host is declared big enough for all
                    capacity=Capacity(
                        max_sandboxes=sandboxes,
                        cpus=sandboxes * env.limits.cpus,
                        memory_mb=sandboxes * env.limits.memory_mb,
                    ),
                    backend=DockerBackendConfig(
                        owner=OWNER,
                        api_workers=32,
                        api_timeout_s=600,
                        **({} if admission else {"exec_admission_hold_s": 0}),
                    ),
                    pool=PoolConfig(
                        max_idle_total=sandboxes, max_idle_per_pool=sandboxes, refill_concurrency=16, idle_ttl_s=3600
                    ),
                    workers=workers,
                    environments=["bench.scale:LightEnv"],  # by module path: this file may run as __main__
                ),
                registry=registry,
            )
        except BaseException:
            policy_proc.terminate()
            await policy_proc.wait()
            raise
        tune_gc()  # as `envfleet serve` does
        assert orch.pool is not None
        pool = orch.pool
        try:
            # 1. warm the sandboxes, watching memory
            # what the runner asks: pools are kept per tenant, and this server's jobs belong to the local tenant
            spec = SandboxSpec(
                image=image, limits=env.limits, env=dict(DETERMINISTIC_ENV), labels={TENANT_LABEL: LOCAL_TENANT}
            )
            pool.warm(spec)
            held: list[Sandbox] = []
            limit_mb = 0.9 * total_memory_mb()
            t0 = time.monotonic()
            stopped_early = ""
            while len(held) < sandboxes:
                batch = min(32, sandboxes - len(held))
                got = await asyncio.gather(*(pool.backend.create(spec) for _ in range(batch)), return_exceptions=True)
                held += [g for g in got if not isinstance(g, BaseException)]
                errors = [g for g in got if isinstance(g, BaseException)]
                if errors:
                    log.warning("%d creates failed, e.g. %s", len(errors), errors[0])
                per = (used_memory_mb() - mem_before) / max(len(held), 1)
                if used_memory_mb() + per * batch > limit_mb:
                    stopped_early = f"stopped at {len(held)}: the next batch would pass 90% of host memory"
                    break
                if len(held) % 128 < batch:
                    log.warning("%d sandboxes up (%.1f MB each so far)", len(held), per)
            warm_s = time.monotonic() - t0
            await asyncio.sleep(2)
            # what the sandboxes cost doing nothing: envd's and the shim's timers, per idle sandbox
            idle_s = 10.0
            cpu0 = proc_cpu.read()
            await asyncio.sleep(idle_s)
            result["idle_cpu_ms_per_s_per_sandbox"] = proc_cpu.per(cpu0, proc_cpu.read(), idle_s * max(len(held), 1))
            peak = len(held)
            mem_peak = used_memory_mb()
            result["peak_concurrent_sandboxes"] = peak
            result["host_mem_per_sandbox_mb"] = round((mem_peak - mem_before) / max(peak, 1), 2)
            result["warm_up_s"] = round(warm_s, 1)
            if stopped_early:
                result["note"] = stopped_early
            # hand them to the pool, so the rollouts find them warm
            for sb in held:
                assert await pool.release(sb, recycle=True)
            # 2. 64 concurrent acquires from the warm pool
            lat: list[float] = []
            for _ in range(5):

                async def one() -> tuple[object, float]:
                    t = time.perf_counter()
                    s, _ = await pool.acquire(spec)
                    return s, time.perf_counter() - t

                got2 = await asyncio.gather(*(one() for _ in range(64)))
                lat += [d for _, d in got2]
                for s, _ in got2:
                    await pool.release(s, recycle=True)  # type: ignore[arg-type]
            lat.sort()
            p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
            result["acquire_p50_ms"] = round(p50 * 1000, 2)
            result["acquire_p99_ms"] = round(p99 * 1000, 2)
            result["acquire_p99_over_p50"] = round(p99 / p50, 2)
            # the same sandboxes idle in the pool past freeze_idle_after_s: frozen, beside the idle figure above
            await asyncio.sleep(pool.config.freeze_idle_after_s + 2)
            frozen = pool.metrics.registry.get_sample_value("envfleet_pool_frozen") or 0
            cpu0 = proc_cpu.read()
            await asyncio.sleep(idle_s)
            result["idle_frozen"] = {
                "frozen": int(frozen),
                "cpu_ms_per_s_per_sandbox": proc_cpu.per(cpu0, proc_cpu.read(), idle_s * max(len(held), 1)),
            }
            if workers:
                # the workers hold their own sandboxes: these would only double the memory
                await pool.close()
                result["workers"] = workers
            # 3. the rollouts, all sandboxes in flight; the trainer is a process of its own (as it is in a real
            # fleet: its decoding of the stream is not the control plane's work), and like a trainer that hands
            # rollouts on it keeps only their statuses
            ids = [t.id for t in env.tasks()]
            job = JobSpec(
                env=env.name,
                policy=PolicyEndpoint(base_url=policy_url, request_timeout_s=600),
                max_concurrency=peak,
                rollout_timeout_s=900,
                tasks=TaskSelection(kind="ids", ids=ids[:rollouts]),
            )
            by, big_s, _ = await timed_job(orch.address, job)
            result["rollouts_per_min_at_peak"] = round(sum(by.values()) / big_s * 60, 1)
            result["rollouts_ok"] = by.pop("OK", 0)
            result["rollouts_failed"] = dict(by)
            # 4. efficiency at eff_concurrency, every policy answer after exactly `latency`: the rollouts of a wave
            # stay in step, and their execs land on the host together
            ids4 = ids[rollouts : rollouts + eff_rollouts]
            result.update(await _efficiency(orch, job, ids4, eff_concurrency, latency))
            # 4b. the same with answers spread over latency +- SPREAD (the mean unchanged, so the ideal is too), as a
            # model server's answers are: waves drift apart and the host's CPU is asked for evenly
            spread_proc, spread_url = await _start_policy(Path(data) / "script.json", latency, jitter=SPREAD * latency)
            try:
                spread_job = job.model_copy(update={"policy": job.policy.model_copy(update={"base_url": spread_url})})
                ids5 = ids[rollouts + eff_rollouts : rollouts + eff_rollouts + spread_rollouts]
                spread = await _efficiency(orch, spread_job, ids5, eff_concurrency, latency)
            finally:
                spread_proc.terminate()
                await spread_proc.wait()
            result["efficiency_spread"] = spread["efficiency"]
            result["efficiency_spread_detail"] = {"latency_spread_s": SPREAD * latency, **spread["efficiency_detail"]}
        finally:
            await orch.stop(grace=1)
            policy_proc.terminate()
            await policy_proc.wait()
    await asyncio.sleep(1)
    result["leaked_containers"] = len(client.api.containers(all=True, filters={"label": f"envfleet.owner={OWNER}"}))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sandboxes", type=int, default=1000)
    p.add_argument("--rollouts", type=int, default=2000)
    p.add_argument("--latency", type=float, default=1.0)
    p.add_argument("--efficiency-concurrency", type=int, default=256)
    p.add_argument("--efficiency-rollouts", type=int, default=768)
    p.add_argument(
        "--spread-rollouts", type=int, default=2048, help="phase 4b's rollouts (8 a slot: the steady rate has a window)"
    )
    p.add_argument("--workers", type=int, default=2, help="rollout worker processes (0: rollouts in the server)")
    p.add_argument("--no-exec-admission", action="store_true", help="every exec at once (as before exec_admission)")
    p.add_argument("--out", type=Path, default=Path("bench/results.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    res = asyncio.run(
        run(
            args.sandboxes,
            args.rollouts,
            args.latency,
            args.efficiency_concurrency,
            args.efficiency_rollouts,
            args.workers,
            args.spread_rollouts,
            not args.no_exec_admission,
        )
    )
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results["scale"] = res
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
