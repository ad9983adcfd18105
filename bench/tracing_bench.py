"""What tracing costs (key `tracing` in bench/results.json): CPU per rollout of the process that runs rollouts, with
tracing on (OTLP over gRPC to a collector in another process, so its CPU is not counted) over off, the same light
workload (python-tool on the fake backend, the replay policy, rollouts in the server process), interleaved so that
the host's noise hits both. Light rollouts cost little CPU of their own, so the ratio is an upper bound: a rollout
with a real model and real commands spends far more beside the same dozen spans."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.core.tracing import TracingConfig
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.service.scheduler import Capacity

ENV = "python-tool"
OWNER = "envfleet-bench-tracing"

_COLLECTOR = """
import asyncio, sys
from orchestrator.testing.otlp_collector import OTLPCollector

async def main():
    collector = await OTLPCollector("grpc").start()
    print(collector.endpoint, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes our stdin
    await collector.close()
    print(len(collector.spans), flush=True)

asyncio.run(main())
"""


def _job(ids: list[str], n: int) -> JobSpec:
    return JobSpec(
        env=ENV,
        tasks=TaskSelection(kind="ids", ids=ids),
        group_size=n,
        policy=PolicyEndpoint(base_url=REPLAY_URL),
        max_concurrency=64,
        max_infra_retries=0,
    )


async def _drain(orch: Orchestrator, spec: JobSpec) -> Counter[str]:
    job_id, _ = await orch.jobs.submit(spec)
    return Counter(
        [e.rollout().status.value async for b in orch.jobs.stream(job_id, max_in_flight=100_000) for e in b.entries]
    )


async def cpu_per_rollout(data: Path, total: int, tracing: TracingConfig) -> tuple[float, int]:
    """This process's CPU seconds per rollout over one job of `total` light rollouts; and how many ran in all."""
    ids = [t.id for t in Registry.from_entry_points().get(ENV).tasks()]
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=data,
            max_in_flight=64,
            capacity=Capacity(max_sandboxes=64, cpus=512.0, memory_mb=64 * 8192),
            backend=FakeBackendConfig(owner=OWNER),
            tracing=tracing,
        )
    )
    try:
        warm = await _drain(orch, _job(ids[:16], 1))  # code paths and the pool warm before the clock starts
        cpu0 = time.process_time()
        counts = await _drain(orch, _job(ids, -(-total // len(ids))))
        cpu = time.process_time() - cpu0
    finally:
        await orch.stop(grace=1)  # with tracing on, this exports what is left: not counted (after the clock)
    assert set(counts) == {"OK"}, counts
    done = sum(counts.values())
    return cpu / done, done + sum(warm.values())


async def run(total: int = 2000, rounds: int = 3) -> dict[str, Any]:
    """Tracing on over off, `rounds` interleaved pairs of `total` rollouts each."""
    collector = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _COLLECTOR, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert collector.stdin is not None and collector.stdout is not None
    endpoint = (await collector.stdout.readline()).decode().strip()
    off: list[float] = []
    on: list[float] = []
    traced = 0
    try:
        for r in range(rounds):
            with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as data:
                for side in ("off", "on") if r % 2 == 0 else ("on", "off"):  # each first in turn
                    config = TracingConfig(otlp_endpoint=endpoint) if side == "on" else TracingConfig()
                    per, ran = await cpu_per_rollout(Path(data) / side, total, config)
                    (on if side == "on" else off).append(per)
                    traced += ran if side == "on" else 0
    finally:
        collector.stdin.close()
        received = int((await collector.stdout.readline()).decode().strip() or 0)
        await collector.wait()
    a, b = statistics.median(off), statistics.median(on)
    spans = received / traced
    return {
        "cpu_us_per_rollout_off": round(a * 1e6),
        "cpu_us_per_rollout_on": round(b * 1e6),
        "ratio": round(b / a, 3),
        # every span of every rollout reached the collector (none dropped by the exporter's bounded queue)
        "spans_per_rollout": round(spans, 2),
        "cpu_us_per_span": round((b - a) * 1e6 / spans, 1),
        "rollouts": total,
        "rounds": rounds,
        "exporter": "otlp grpc, batched",
    }


def main() -> None:
    """`python -m bench.tracing_bench [--out bench/results.json]`: measure and merge under `tracing`."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--total", type=int, default=2000)
    args = p.parse_args()
    result = asyncio.run(run(args.total))
    if args.out is not None:
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        results["tracing"] = result
        args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
