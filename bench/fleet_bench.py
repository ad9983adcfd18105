"""Control plane and rollout workers, measured side by side in one run (keys under `fleet` in bench/results.json).

- `workers_speedup`: rollouts/s with 2 worker processes over 1, the same light workload (python-tool on the fake
  backend, the replay policy: no model latency), the control plane the same; with a trainer that reads models, and
  again with one that reads the protobuf messages (`messages_reader`), a quarter of the trainer's CPU per rollout.
- `submit_latency`: p50 and p99 of SubmitJob under 200 concurrent one-task submits, from a client process of its
  own against `envfleet serve` (fake backend, 2 workers), beside the same burst of calls to a bare grpc.aio server
  from the same kind of process; with the control plane's CPU per submit and the bare server's per call (process
  time over the burst), the steadier figures on a shared host. Every submitted job runs (the replay policy): the
  bench waits for all of them and reports how many completed.
- `control_plane`: with the fake backend and the replay policy on 8 worker processes, the rollouts/s one control
  plane delivers and its own CPU per rollout (this process's CPU time; the trainer that drains the stream is a
  process of its own), so its capacity per core follows.
- `paced`: the control plane's and the trainer's CPU per rollout when results come one by one (about 60 a second,
  as on real Docker here), where each stream message, log read and Ack carries one rollout unless they are paced.
- `fleet_sim`: the fake backend in worker processes holding 10,000 concurrent sandboxes and running 50,000 rollouts
  through the production scheduler, delivery and result log: lost, duplicated, and the p99 dispatch delay (the round
  trip from the control plane sending a rollout to a worker to taking its result, less the rollout's own run time).
- `declarative_tasks`: a declarative environment of 10,000 tasks (a spec of about 2.5 MB) beside python-tool, the same
  number of light rollouts of each on one control plane and 2 workers: rollouts/s and CPU per rollout of both, and
  their ratio. A job's spec and its declarative environment's travel to a worker once a stream
  (WorkerHello.keeps_specs); sent with each assignment, the 2.5 MB went with every rollout.
- `job_table`: what 4,000 finished jobs cost a control plane that keeps them (ListJobs, GetJob, a restart, the
  result log's bytes per job), and a restart past their retention: how long the removal takes and what is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from bench import proc_cpu
from orchestrator.backends.config import FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import DEFAULT_JOB_RETENTION_S, JobSpec, RolloutStatus, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.core.runtime import tune_gc
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.server.convert_specs import spec_to_pb
from orchestrator.service.caps import CapsConfig
from orchestrator.service.declarative import parse_spec
from orchestrator.service.registry import Registry
from orchestrator.service.scheduler import Capacity
from protos import orchestrator_pb2 as pb

ENV = "python-tool"
OWNER = "envfleet-bench-fleet"


def _job(ids: list[str], n: int = 1, concurrency: int = 4096) -> JobSpec:
    return JobSpec(
        env=ENV,
        tasks=TaskSelection(kind="ids", ids=ids),
        group_size=n,
        policy=PolicyEndpoint(base_url=REPLAY_URL),
        max_concurrency=concurrency,
        max_infra_retries=0,
    )


async def _plane(
    data: Path, workers: int, in_flight: int, retention_s: float | None = DEFAULT_JOB_RETENTION_S, **fake: Any
) -> Orchestrator:
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=data,
            max_in_flight=in_flight,
            job_retention_s=retention_s,
            capacity=Capacity(max_sandboxes=in_flight, cpus=in_flight * 8.0, memory_mb=in_flight * 8192),
            backend=FakeBackendConfig(owner=OWNER, **fake),
            workers=workers,
            metrics_port=None,
            # 200 one-task jobs at once are the submit benchmark; the job table's keeps 4,000 finished ones
            caps=CapsConfig(jobs_per_tenant=10_000, finished_jobs_per_tenant=10_000),
        )
    )
    assert orch.workers is not None
    await orch.workers.hub.wait_for_workers(workers, timeout_s=120)
    return orch


async def _drain(client: EnvfleetClient, job_id: str) -> Counter[str]:
    return Counter([r.status.value async for r in client.rollouts(job_id, max_in_flight=100_000, max_batch=1024)])


# The trainer of the timed jobs: a process of its own, as a trainer is, so that the control plane's CPU time is its
# own. It connects, says "ready", and on "go" submits the job and drains its stream; then it prints the rollouts'
# statuses and when each arrived (seconds after the submit, by the host's monotonic clock). It reads the rollouts as
# models (`rollouts`, "models") or as the wire's protobuf messages (`rollout_messages`, "messages").
_CONSUMER = """
import asyncio, collections, json, sys, time
from orchestrator.client.convert import ROLLOUT_STATUS_FROM_PB
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec

async def main(address, spec_json, reader):
    spec = JobSpec.model_validate_json(spec_json)
    async with EnvfleetClient(address, timeout_s=600) as client:
        await client.list_jobs()  # the channel is up before the clock starts
        print("ready", flush=True)
        sys.stdin.readline()
        t0 = time.monotonic()
        job_id = await client.submit(spec)
        statuses, arrivals = [], []
        if reader == "messages":
            async for m in client.rollout_messages(job_id, max_in_flight=100_000, max_batch=1024):
                statuses.append(m.status)
                arrivals.append(time.monotonic() - t0)
            statuses = [ROLLOUT_STATUS_FROM_PB[s].value for s in statuses]
        else:
            async for r in client.rollouts(job_id, max_in_flight=100_000, max_batch=1024):
                statuses.append(r.status.value)
                arrivals.append(time.monotonic() - t0)
        print(json.dumps(collections.Counter(statuses)), flush=True)
        print(json.dumps([round(t, 4) for t in arrivals]), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
"""


async def timed_job(
    address: str, spec: JobSpec, arrivals: list[float] | None = None, reader: str = "models"
) -> tuple[Counter[str], float, float]:
    """Run one job from a trainer process of its own: its rollouts by status, the seconds from submit to its last
    rollout, and this process's CPU seconds meanwhile; `arrivals`, when given, gets each rollout's arrival (seconds
    after the submit, in the order they came). `reader`: the trainer reads "models" or protobuf "messages"."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CONSUMER,
        address,
        spec.model_dump_json(),
        reader,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=64 << 20,  # a line of every rollout's arrival time
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if (await proc.stdout.readline()).strip() != b"ready":
            raise RuntimeError("the bench's trainer process did not start")
        cpu0, t0 = time.process_time(), time.perf_counter()
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        counts: Counter[str] = Counter(json.loads(await proc.stdout.readline()))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        times = json.loads(await proc.stdout.readline())
        if arrivals is not None:
            arrivals.extend(times)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    return counts, elapsed, cpu


def _reaped_cpu_s() -> float:
    """CPU seconds of this process's children reaped so far: the workers live on, so between two readings around
    `timed_job` it is the trainer's."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


async def rollouts_per_s(workers: int, total: int, in_flight: int = 1024, reader: str = "models") -> dict[str, Any]:
    """One job of `total` light rollouts on `workers` worker processes: rollouts/s from submit to the last one, the
    trainer reading them as `reader` (timed_job). `in_flight` is deep enough that the host's CPU is the bound, not
    the round trip: at 128 one worker used 74% of its core and two 85% of one between them (2026-12-02), so the
    ratio measured the pipeline's latency."""
    ids = [t.id for t in Registry.from_entry_points().get(ENV).tasks()]
    n = -(-total // len(ids))
    with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as data:
        orch = await _plane(Path(data), workers, in_flight=in_flight)
        try:
            async with EnvfleetClient(orch.address, timeout_s=600) as client:
                await _drain(client, await client.submit(_job(ids[:4])))  # warm the workers' pools and code
            before, reaped = proc_cpu.read(), _reaped_cpu_s()
            counts, elapsed, _ = await timed_job(orch.address, _job(ids, n=n), reader=reader)
            after, trainer = proc_cpu.read(), _reaped_cpu_s() - reaped
        finally:
            await orch.stop(grace=1)
    done = sum(counts.values())
    # by process: the control plane (this one), its workers, and the trainer (the one child reaped meanwhile)
    cpu = {k: v for k, v in proc_cpu.per(before, after, done, 1e6).items() if k in ("control_plane", "workers")}
    cpu["trainer"] = round(trainer / done * 1e6, 1)
    return {
        "rollouts_per_s": round(done / elapsed, 1),
        "cpu_us_per_rollout": cpu,
        "ok": counts["OK"],
        "n": done,
    }


async def workers_speedup(total: int = 20_000) -> dict[str, Any]:
    """2 workers over 1 on the same workload, interleaved twice (each first in turn) so that the host's noise hits
    both; once with a trainer that reads models (the top-level figures, as in earlier runs) and once with one that
    reads protobuf messages (`messages_reader`)."""
    runs: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {"models": ([], []), "messages": ([], [])}
    for r in range(2):
        for reader, (one, two) in runs.items():
            for workers in (1, 2) if r % 2 == 0 else (2, 1):
                (one if workers == 1 else two).append(await rollouts_per_s(workers, total, reader=reader))
    return {**_speedup(*runs["models"]), "messages_reader": _speedup(*runs["messages"])}


def _speedup(one: list[dict[str, Any]], two: list[dict[str, Any]]) -> dict[str, Any]:
    a = round(statistics.median(r["rollouts_per_s"] for r in one), 1)
    b = round(statistics.median(r["rollouts_per_s"] for r in two), 1)
    cores = os.cpu_count() or 1
    # what the CPU per rollout allows: every core busy at the two-worker runs' cost of a rollout (workers, control
    # plane and trainer together), over the one-worker rate. The control plane and the trainer share the cores with
    # the workers here, so this, not the worker count, bounds the ratio on a small host.
    per_rollout = statistics.median(sum(r["cpu_us_per_rollout"].values()) for r in two)
    return {
        "one_worker_per_s": a,
        "two_workers_per_s": b,
        "ratio": round(b / a, 3),
        "ratio_bound_from_cpu": round(cores * 1e6 / per_rollout / a, 3),
        "cpu_us_per_rollout": {
            "one_worker": _median_split([r["cpu_us_per_rollout"] for r in one]),
            "two_workers": _median_split([r["cpu_us_per_rollout"] for r in two]),
        },
        "cpus": cores,
    }


def _median_split(splits: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(s.get(k, 0.0) for s in splits), 1) for k in splits[0]}


_SUBMITTER = """
import asyncio, json, sys, time
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec

async def main(address, spec_json, n):
    spec = JobSpec.model_validate_json(spec_json)
    async with EnvfleetClient(address) as client:
        await client.submit(spec)  # the channel is up before the clock starts
        async def one():
            t0 = time.perf_counter()
            await client.submit(spec)
            return time.perf_counter() - t0
        print(json.dumps(await asyncio.gather(*(one() for _ in range(n)))))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


# The floor under it: the same burst of unary calls to a bare grpc.aio server (the health check, no handler work),
# from a process of the same kind. grpc.aio accepts one call per trip through its completion queue and the event
# loop, so a burst queues there before any handler runs.
_BARE = """
import asyncio, json, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

async def main(address, n):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest())
        async def one():
            t0 = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest())
            return time.perf_counter() - t0
        print(json.dumps(await asyncio.gather(*(one() for _ in range(n)))))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def _burst(script: str, *args: str) -> list[float]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, *args, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return sorted(json.loads(out))


def _ms(lat: list[float], q: float) -> float:
    return round(lat[int(q * (len(lat) - 1))] * 1000, 1)


async def _timed_burst(script: str, *args: str) -> tuple[list[float], float]:
    """A burst's latencies, and this process's CPU seconds over it (the servers under test run in this process)."""
    cpu0 = time.process_time()
    lat = await _burst(script, *args)
    return lat, time.process_time() - cpu0


async def _all_finished(address: str, timeout_s: float = 300) -> tuple[int, int]:
    """Wait until every job on the control plane is finished: (jobs completed, their OK rollouts)."""
    async with EnvfleetClient(address, timeout_s=60) as client:
        async with asyncio.timeout(timeout_s):
            while True:
                jobs = await client.list_jobs()
                if all(j.state.value in ("COMPLETED", "CANCELLED") for j in jobs):
                    done = [j for j in jobs if j.state.value == "COMPLETED"]
                    return len(done), sum(j.by_status.get(RolloutStatus.OK, 0) for j in done)
                await asyncio.sleep(0.5)


async def submit_latency(concurrent: int = 200, rounds: int = 5) -> dict[str, Any]:
    """p50/p99 of SubmitJob under `concurrent` one-task submits from another process, and of the same burst of
    health checks on a bare grpc.aio server (the floor), interleaved; the medians over `rounds`. Then every job
    submitted (the client's warm-up one each round too) must run to its end."""
    task = Registry.from_entry_points().get(ENV).tasks()[0].id
    spec = _job([task])
    bare = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), bare)
    bare_address = f"127.0.0.1:{bare.add_insecure_port('127.0.0.1:0')}"
    await bare.start()
    ours: list[tuple[list[float], float]] = []
    floor: list[tuple[list[float], float]] = []
    with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as data:
        orch = await _plane(Path(data), 2, in_flight=256)
        try:
            bursts = [
                (floor, (_BARE, bare_address, str(concurrent))),
                (ours, (_SUBMITTER, orch.address, spec.model_dump_json(), str(concurrent))),
            ]
            for r in range(rounds):  # each first in turn
                for into, burst in bursts if r % 2 == 0 else bursts[::-1]:
                    into.append(await _timed_burst(*burst))
                    # the jobs run to their end before the next burst: the floor's CPU (this process's) counted
                    # the control plane still at the last round's rollouts
                    await _all_finished(orch.address)
            completed, ok = await _all_finished(orch.address)
        finally:
            await orch.stop(grace=1)
            await bare.stop(0)
    p50 = statistics.median(_ms(lat, 0.5) for lat, _ in ours)
    p99 = statistics.median(_ms(lat, 0.99) for lat, _ in ours)
    base50 = statistics.median(_ms(lat, 0.5) for lat, _ in floor)
    base99 = statistics.median(_ms(lat, 0.99) for lat, _ in floor)
    return {
        "p50_ms": p50,
        "p99_ms": p99,
        "bare_grpc_p50_ms": base50,
        "bare_grpc_p99_ms": base99,
        "p99_ratio_to_bare_grpc": round(p99 / base99, 2),
        # the control plane's CPU (gRPC, handler, store, and the rollouts it dispatches meanwhile) per submit
        "cpu_ms_per_submit": round(statistics.median(cpu for _, cpu in ours) * 1000 / concurrent, 2),
        "bare_grpc_cpu_ms_per_call": round(statistics.median(cpu for _, cpu in floor) * 1000 / concurrent, 2),
        "jobs_submitted": rounds * (concurrent + 1),
        "jobs_completed": completed,
        "ok_rollouts": ok,
        "concurrent": concurrent,
        "rounds": rounds,
    }


async def control_plane(total: int = 8000, workers: int = 8) -> dict[str, Any]:
    """Rollouts/s through one control plane with `workers` worker processes, and its CPU per rollout."""
    ids = [t.id for t in Registry.from_entry_points().get(ENV).tasks()]
    n = -(-total // len(ids))
    with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as data:
        orch = await _plane(Path(data), workers, in_flight=512)
        try:
            async with EnvfleetClient(orch.address, timeout_s=600) as client:
                await _drain(client, await client.submit(_job(ids[:16])))
            counts, elapsed, cpu = await timed_job(orch.address, _job(ids, n=n))
        finally:
            await orch.stop(grace=1)
    done = sum(counts.values())
    us = cpu / done * 1e6
    return {
        "rollouts_per_s": round(done / elapsed, 1),
        # this process is the control plane alone (the trainer is a process of its own): gRPC, jobs, the result log
        "cpu_us_per_rollout": round(us),
        "rollouts_per_s_per_core_capacity": round(1e6 / us),
        "workers": workers,
        "ok": counts["OK"],
        "n": done,
    }


async def paced(total: int = 1200, in_flight: int = 64, exec_s: float = 1.0) -> dict[str, Any]:
    """The control plane's and the trainer's CPU per rollout when results come one by one, as on real Docker (about
    60 a second here: each fake command takes `exec_s`), rather than in the thousands a second of `control_plane`,
    where every message carries many: what a batch, a log read and an Ack cost each rollout when each carries one."""
    ids = [t.id for t in Registry.from_entry_points().get(ENV).tasks()]
    n = -(-total // len(ids))
    with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as data:
        orch = await _plane(Path(data), 2, in_flight=in_flight, exec_latency_s=exec_s)
        try:
            async with EnvfleetClient(orch.address, timeout_s=600) as client:
                await _drain(client, await client.submit(_job(ids[:4])))
            reaped = _reaped_cpu_s()
            counts, elapsed, cpu = await timed_job(orch.address, _job(ids, n=n))
            trainer = _reaped_cpu_s() - reaped
        finally:
            await orch.stop(grace=1)
    done = sum(counts.values())
    return {
        "rollouts_per_s": round(done / elapsed, 1),
        "control_plane_cpu_us_per_rollout": round(cpu / done * 1e6),
        "trainer_cpu_us_per_rollout": round(trainer / done * 1e6),
        "ok": counts["OK"],
        "n": done,
    }


def _many_tasks_spec(tasks: int) -> pb.EnvironmentSpec:
    """A declarative environment of `tasks` small tasks whose reference answers and scores 1 (the fake backend echoes
    the scoring command's output)."""
    text = "say the number of the task, then submit it. " * 4
    spec = parse_spec(
        {
            "name": "many-tasks",
            "version": "1",
            "tools": ["submit"],
            "tasks": [
                {
                    "id": f"t-{i}",
                    "prompt": f"Task {i}: {text}",
                    "data": {"expected": i},
                    "reference": [{"name": "submit", "arguments": {"answer": str(i)}}],
                }
                for i in range(tasks)
            ],
            "scoring": {"command": """echo '{"reward": 1}'""", "timeout_s": 30},
        }
    )
    return spec_to_pb(spec)


async def declarative_tasks(tasks: int = 10_000, total: int = 4_000) -> dict[str, Any]:
    """`total` rollouts of a declarative environment of `tasks` tasks, and as many of python-tool, on one control plane
    with 2 workers (the replay policy, the fake backend)."""
    ids = [t.id for t in Registry.from_entry_points().get(ENV).tasks()]
    declared = _many_tasks_spec(tasks)
    many = _job(["x"]).model_copy(
        update={"env": "many-tasks@1", "tasks": TaskSelection(kind="sample", count=total), "group_size": 1}
    )
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as data:
        orch = await _plane(Path(data), 2, in_flight=1024)
        try:
            async with EnvfleetClient(orch.address, timeout_s=600) as client:
                await client.env_stub.Register(declared)
                for job in (_job(ids[:4]), many.model_copy(update={"tasks": TaskSelection(kind="sample", count=4)})):
                    await _drain(client, await client.submit(job))  # the workers' pools, code and environments warm
            for name, job in (("python_tool", _job(ids, n=-(-total // len(ids)))), ("declarative", many)):
                before = proc_cpu.read()
                counts, elapsed, _ = await timed_job(orch.address, job, reader="messages")
                after = proc_cpu.read()
                done = sum(counts.values())
                cpu = proc_cpu.per(before, after, done, 1e6)
                runs[name] = {
                    "rollouts_per_s": round(done / elapsed, 1),
                    "cpu_us_per_rollout": {k: cpu.get(k, 0.0) for k in ("control_plane", "workers")},
                    "ok": counts["OK"],
                    "n": done,
                }
        finally:
            await orch.stop(grace=1)
    return {
        **runs,
        "tasks": tasks,
        "spec_bytes": declared.ByteSize(),
        "rate_ratio": round(runs["declarative"]["rollouts_per_s"] / runs["python_tool"]["rollouts_per_s"], 3),
    }


async def fleet_sim(concurrent: int = 10_000, total: int = 50_000, workers: int = 2) -> dict[str, Any]:
    """`concurrent` fake sandboxes held at once by worker processes, `total` rollouts through the real control plane
    (in as many jobs as a job's concurrency cap of 4096 needs, so fair share between jobs is in play too)."""
    ids = [t.id for t in Registry.from_entry_points().get(ENV).tasks()]
    jobs = -(-concurrent // 4096)
    n = -(-total // (jobs * len(ids)))
    with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as data:
        # each command takes 1 s, so a rollout holds its sandbox about 1 s and the fleet runs at `concurrent`
        orch = await _plane(Path(data), workers, in_flight=concurrent, exec_latency_s=1.0)
        assert orch.workers is not None
        hub = orch.workers.hub
        peak = 0
        seen: Counter[str] = Counter()
        statuses: Counter[str] = Counter()
        expected: set[str] = set()
        try:
            async with EnvfleetClient(orch.address, timeout_s=3600) as client:
                job_ids = [await client.submit(_job(ids, n=n, concurrency=-(-concurrent // jobs))) for _ in range(jobs)]
                expected = {f"{j}:{i}:{k}" for j in job_ids for i in ids for k in range(n)}

                async def watch() -> None:
                    nonlocal peak
                    while True:
                        peak = max(peak, sum(w.running for w in hub.workers()))
                        await asyncio.sleep(0.5)

                async def consume(job_id: str) -> None:
                    async for r in client.rollouts(job_id, max_in_flight=100_000, max_batch=1024):
                        seen[r.id] += 1
                        statuses[r.status.value] += 1

                watcher = asyncio.create_task(watch())
                t0 = time.perf_counter()
                await asyncio.gather(*(consume(j) for j in job_ids))
                elapsed = time.perf_counter() - t0
                watcher.cancel()
        finally:
            await orch.stop(grace=1)
    delays = sorted(hub.dispatch_delays)
    return {
        "rollouts": sum(seen.values()),
        "jobs": jobs,
        "lost": len(expected - set(seen)),
        "unexpected_ids": len(set(seen) - expected),
        # at-least-once: an id may come twice (dropped by id); after that, every rollout is there exactly once
        "delivered_more_than_once": sum(c > 1 for c in seen.values()),
        "by_status": dict(statuses),
        "peak_concurrent_sandboxes": peak,
        "target_concurrent_sandboxes": concurrent,
        "rollouts_per_s": round(sum(seen.values()) / elapsed, 1),
        "dispatch_delay_p50_ms": round(statistics.median(delays) * 1000, 1) if delays else None,
        "dispatch_delay_p99_ms": round(delays[int(0.99 * (len(delays) - 1))] * 1000, 1) if delays else None,
        "workers": workers,
        "seconds": round(elapsed, 1),
    }


async def job_table(jobs: int = 4000, wave: int = 50) -> dict[str, Any]:
    """What finished jobs cost a control plane: ListJobs (and GetJob) with `jobs` finished one-task jobs kept, a
    restart that reads them back, the result log's bytes per job; then a restart whose retention has run out for all
    of them, and what it leaves (run in waves of `wave` jobs, under the default streams-per-tenant cap)."""
    task = Registry.from_entry_points().get(ENV).tasks()[0].id
    with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as folder:
        data = Path(folder)
        orch = await _plane(data, 1, in_flight=256)
        try:
            async with EnvfleetClient(orch.address, timeout_s=600) as client:
                ids: list[str] = []
                for _ in range(0, jobs, wave):
                    batch = await asyncio.gather(*(client.submit(_job([task])) for _ in range(wave)))
                    await asyncio.gather(*(_drain(client, j) for j in batch))
                    ids += batch
                list_s, get_s = [], []
                for _ in range(3):
                    t0 = time.perf_counter()
                    listed = await client.list_jobs()
                    list_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    await client.get_job(ids[0])
                    get_s.append(time.perf_counter() - t0)
        finally:
            await orch.stop(grace=1)
        log_bytes = orch.store.size_bytes()
        t0 = time.perf_counter()
        orch = await _plane(data, 1, in_flight=256)
        restart_s = time.perf_counter() - t0
        await orch.stop(grace=1)
        t0 = time.perf_counter()
        orch = await _plane(data, 1, in_flight=256, retention_s=0.0)  # every job's retention has run out
        removal_restart_s = time.perf_counter() - t0
        try:
            async with EnvfleetClient(orch.address, timeout_s=600) as client:
                left = len(await client.list_jobs())
        finally:
            await orch.stop(grace=1)
        with sqlite3.connect(data / "results.sqlite3") as db:
            (rows,) = db.execute("SELECT COUNT(*) FROM rollouts").fetchone()
    return {
        "jobs": len(listed),
        "list_jobs_ms": round(statistics.median(list_s) * 1000, 1),
        "get_job_ms": round(statistics.median(get_s) * 1000, 2),
        "restart_s": round(restart_s, 2),
        "log_bytes_per_job": round(log_bytes / len(ids)),  # its one rollout (JSON and wire form) and its row
        "restart_removing_all_s": round(removal_restart_s, 2),
        "jobs_left": left,
        "rollout_rows_left": rows,
    }


async def run_all() -> dict[str, Any]:
    """Every fleet figure, one after another."""
    return {
        "workers_speedup": await workers_speedup(),
        "submit_latency": await submit_latency(),
        "control_plane": await control_plane(),
        "paced": await paced(),
        "fleet_sim": await fleet_sim(),
        "job_table": await job_table(),
        "declarative_tasks": await declarative_tasks(),
    }


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    benches: dict[str, Callable[[], Coroutine[Any, Any, dict[str, Any]]]] = {
        "speedup": workers_speedup,
        "submit": submit_latency,
        "control": control_plane,
        "paced": paced,
        "sim": fleet_sim,
        "jobs": job_table,
        "declarative": declarative_tasks,
    }
    fn = benches.get(which)
    tune_gc()  # the control plane runs in this process: tuned as `envfleet serve` tunes it
    print(json.dumps(asyncio.run(fn() if fn else run_all()), indent=2))
