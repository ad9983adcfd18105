"""`policy_outage`: what a job delivers when its policy server goes away mid-job and comes back, with the outage wait
(PolicyEndpoint.outage_wait_s, the default 300 s) against without it (0: the behaviour before it).

One in-process orchestrator (real gRPC, jobs, store and stream; the fake backend, so no Docker time blurs it) runs
the same python-tool job twice, each side first in turn across `rounds`, against the scripted policy double in this
process: once a quarter of the job's rollouts are done, the double is closed (what it holds is answered 503, then
nothing listens) for `outage_s` and started again on the same port. Each side reports its rollouts by status, the
job's wall time and the longest wait a rollout reported (`policy_outage_s`).

    python -m bench.outage_bench [--rollouts 64] [--outage-s 10] [--out bench/results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.server.app import OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import ScriptedServer, start_scripted_server
from orchestrator.testing.scripts import reference_script

ENV = "python-tool"
OWNER = "envfleet-bench-outage"


async def _one_job(
    client: EnvfleetClient, script: Any, ids: list[str], group: int, concurrency: int, wait_s: float, outage_s: float
) -> dict[str, Any]:
    server = await start_scripted_server(script)
    port, url = server.port, server.url
    back: ScriptedServer | None = None
    spec = JobSpec(
        env=ENV,
        tasks=TaskSelection(kind="ids", ids=ids),
        group_size=group,
        policy=PolicyEndpoint(base_url=url, model="scripted", outage_wait_s=wait_s),
        max_concurrency=concurrency,
    )
    total = len(ids) * group
    try:
        started = time.monotonic()
        job_id = await client.submit(spec)
        for _ in range(12_000):  # a quarter of the job done: up to 10 minutes
            if (await client.get_job(job_id)).done >= total // 4:
                break
            await asyncio.sleep(0.05)
        await server.close()
        await asyncio.sleep(outage_s)
        back = await start_scripted_server(script, port=port)
        rollouts = [r async for r in client.rollouts(job_id)]
        took = time.monotonic() - started
    finally:
        await server.close()
        if back is not None:
            await back.close()
    by_status = collections.Counter(r.status.value for r in rollouts)
    return {
        "rollouts": len(rollouts),
        "by_status": dict(sorted(by_status.items())),
        "ok_fraction": round(by_status.get("OK", 0) / max(len(rollouts), 1), 4),
        "job_s": round(took, 2),
        "longest_wait_s": round(max((r.metrics.get("policy_outage_s", 0.0) for r in rollouts), default=0.0), 2),
    }


async def policy_outage(
    rollouts: int = 64, concurrency: int = 16, outage_s: float = 10.0, rounds: int = 2
) -> dict[str, Any]:
    """Both sides `rounds` times, each first in turn; the last round's figures, and each round's OK fractions."""
    env = Registry.from_entry_points().get(ENV)
    tasks = list(env.tasks())[:16]
    ids, group = [t.id for t in tasks], max(1, rollouts // len(tasks))
    script = reference_script(env, tasks, latency_s=0.2)
    sides = {"waited_out": 300.0, "no_wait": 0.0}
    figures: dict[str, dict[str, Any]] = {}
    fractions: dict[str, list[float]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="envfleet-outage-bench-") as tmp:
        orch = await create_server(
            OrchestratorConfig(
                port=0, data_dir=Path(tmp) / "data", backend=FakeBackendConfig(owner=OWNER), metrics_port=None
            )
        )
        try:
            async with EnvfleetClient(orch.address) as client:
                for r in range(rounds):
                    for side in list(sides) if r % 2 == 0 else list(reversed(sides)):
                        figures[side] = await _one_job(client, script, ids, group, concurrency, sides[side], outage_s)
                        fractions[side].append(figures[side]["ok_fraction"])
        finally:
            await orch.stop(grace=1)
    return {
        **figures,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ok_fractions": fractions,
        "outage_s": outage_s,
        "rollouts_per_job": len(ids) * group,
        "in_flight": concurrency,
        "note": "the policy double closed once a quarter of the job is done, started again outage_s later; "
        "waited_out: outage_wait_s 300 (the default), no_wait: 0 (before it)",
    }


def main() -> None:
    """Run the measurement alone and print it."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--outage-s", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=None, help="also set `policy_outage` in this results.json")
    args = p.parse_args()
    result = asyncio.run(policy_outage(args.rollouts, outage_s=args.outage_s))
    if args.out is not None:
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        results["policy_outage"] = result
        args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
