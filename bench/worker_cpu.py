"""CPU per rollout of one rollout worker process, and per request of the scripted policy, without Docker.

The scale bench's light rollouts (bench/scale.py `scale-light`: 3 turns, 2 short execs, a submit, reset in place)
on the fake backend: the worker still runs the agent loop, the policy client over real HTTP, scoring, recycling and
the result encoding; only envd's answers are faked. The policy is the scripted server in a process of its own,
answering after `--latency` seconds. Each round is one job of `--rollouts` rollouts at `--concurrency`; the first
warms the pools, the others are measured from /proc: the worker's CPU per rollout, the policy's per request.

    python -m bench.worker_cpu [--concurrency 64] [--rollouts 640] [--rounds 3] [--latency 1.0] [--stream]

With --stream the measured rounds alternate between whole answers and streamed ones (`PolicyEndpoint.stream`: the
scripted server sends each answer in 8 chunks), interleaved because this host is noisy; it reports both medians
and their ratio.

A quick loop for work on the worker's hot path; it writes nothing (bench/scale.py measures the real thing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.scale import LightEnv, _start_policy
from orchestrator.backends.config import FakeBackendConfig
from orchestrator.backends.pool import PoolConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.server.app import OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.service.scheduler import Capacity
from orchestrator.testing.scripts import reference_script

HZ = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its own threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


async def run(
    concurrency: int, rollouts: int, rounds: int, latency: float, stream: bool = False
) -> list[dict[str, Any]]:
    env = LightEnv()
    assert rollouts * rounds <= len(env.tasks())
    ids = [t.id for t in env.tasks()]
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="envfleet-worker-cpu-") as data:
        (Path(data) / "script.json").write_text(reference_script(env, latency_s=latency).model_dump_json())
        policy, url = await _start_policy(Path(data) / "script.json", latency)
        orch = await create_server(
            OrchestratorConfig(
                port=0,
                data_dir=Path(data),
                max_in_flight=concurrency,
                capacity=Capacity(max_sandboxes=concurrency, cpus=concurrency * 8.0, memory_mb=concurrency * 8192),
                backend=FakeBackendConfig(owner="envfleet-bench-worker-cpu"),
                pool=PoolConfig(max_idle_total=concurrency, max_idle_per_pool=concurrency, idle_ttl_s=3600),
                workers=1,
                metrics_port=None,
                environments=["bench.scale:LightEnv"],
            ),
            registry=Registry(),
        )
        try:
            assert orch.workers is not None and orch.workers.local is not None
            await orch.workers.hub.wait_for_workers(1, timeout_s=120)
            (worker,) = orch.workers.local.pids
            async with EnvfleetClient(orch.address, timeout_s=600) as client:
                for rnd in range(rounds):
                    streamed = stream and rnd % 2 == 0  # round 0 (the warm-up) too: the measured ones alternate
                    job = JobSpec(
                        env=env.name,
                        policy=PolicyEndpoint(base_url=url, request_timeout_s=600, stream=streamed),
                        max_concurrency=concurrency,
                        tasks=TaskSelection(kind="ids", ids=ids[rnd * rollouts : (rnd + 1) * rollouts]),
                    )
                    w0, p0, t0 = cpu_s(worker), cpu_s(policy.pid), time.monotonic()
                    got = Counter([r.status.value async for r in client.rollouts(await client.submit(job))])
                    w1, p1, dt = cpu_s(worker), cpu_s(policy.pid), time.monotonic() - t0
                    n = sum(got.values())
                    row = {
                        "round": rnd,
                        "stream": streamed,
                        "rollouts": n,
                        "statuses": dict(got),
                        "seconds": round(dt, 2),
                        "efficiency": round(n / dt / (concurrency / (3 * latency)), 3),
                        "worker_ms_per_rollout": round((w1 - w0) / n * 1000, 2),
                        "policy_ms_per_request": round((p1 - p0) / (3 * n) * 1000, 3),
                    }
                    print(json.dumps(row), flush=True)
                    if rnd:
                        out.append(row)
        finally:
            await orch.stop(grace=1)
            policy.terminate()
            await policy.wait()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rollouts", type=int, default=640)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--latency", type=float, default=1.0)
    p.add_argument("--stream", action="store_true", help="alternate whole and streamed answers (rounds: odd, >= 3)")
    a = p.parse_args()
    rows = asyncio.run(run(a.concurrency, a.rollouts, a.rounds, a.latency, a.stream))
    summary: dict[str, float] = {}
    for mode in sorted({r["stream"] for r in rows}):
        mine = [r for r in rows if r["stream"] == mode]
        worker = sorted(r["worker_ms_per_rollout"] for r in mine)
        policy = sorted(r["policy_ms_per_request"] for r in mine)
        prefix = "streamed_" if mode else ""
        summary[f"{prefix}worker_ms_per_rollout_median"] = worker[len(worker) // 2]
        summary[f"{prefix}policy_ms_per_request_median"] = policy[len(policy) // 2]
    if a.stream:
        ratio = summary["streamed_worker_ms_per_rollout_median"] / summary["worker_ms_per_rollout_median"]
        summary["streamed_over_whole_worker_cpu"] = round(ratio, 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
