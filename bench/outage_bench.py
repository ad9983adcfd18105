"""What a job delivers when a server it depends on goes away mid-job and comes back, with the outage waited out
against without the wait (the behaviour before it):

- `policy_outage`: its policy server (PolicyEndpoint.outage_wait_s, the default 300 s, against 0). One in-process
  orchestrator on the fake backend (no Docker time blurs it); the scripted policy double in this process is closed
  (what it holds is answered 503, then nothing listens) and started again on the same port.
- `engine_outage`: the docker engine (DockerBackendConfig.engine_outage_wait_s, the default 300 s, against 0). An
  in-process orchestrator per side on real Docker, with no warm pool, reaches the engine through a relay
  (orchestrator/testing/engine_relay.py) that is taken down (nothing listens, calls in flight are cut, as while a
  dockerd restarts) and brought back; the sandboxes run on meanwhile.

Each side runs the same python-tool job, each first in turn across `rounds`: once a quarter of its rollouts are
done the server goes away for `outage_s` (10 s for the policy, 40 s for the engine, with 2 rollouts in flight: the
engine call limiter's pauses, up to 5 s between calls, carried a job through about 15 s of it per rollout in flight
before the wait).
Each side reports its rollouts by status, the job's wall time and the longest wait a rollout reported
(`policy_outage_s`, `engine_outage_s`).

    python -m bench.outage_bench [policy|engine] [--rollouts N] [--outage-s S] [--out bench/results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.backends.config import DockerBackendConfig, FakeBackendConfig
from orchestrator.backends.pool import PoolConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.server.app import OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.testing.engine_relay import EngineRelay
from orchestrator.testing.policy_script import Script
from orchestrator.testing.scripted_policy import ScriptedServer, start_scripted_server
from orchestrator.testing.scripts import reference_script

ENV = "python-tool"
OWNER = "envfleet-bench-outage"


@dataclass
class Outage:
    """How one side takes its server down and brings it back."""

    down: Callable[[], Awaitable[None]]
    up: Callable[[], Awaitable[None]]


async def _one_job(
    client: EnvfleetClient, spec: JobSpec, outage: Outage, outage_s: float, metric: str
) -> dict[str, Any]:
    """Run `spec`, taking the server down for `outage_s` once a quarter of its rollouts are done."""
    total = len(spec.tasks.ids) * spec.group_size
    started = time.monotonic()
    job_id = await client.submit(spec)
    for _ in range(12_000):  # a quarter of the job done: up to 10 minutes
        if (await client.get_job(job_id)).done >= total // 4:
            break
        await asyncio.sleep(0.05)
    await outage.down()
    await asyncio.sleep(outage_s)
    await outage.up()
    rollouts = [r async for r in client.rollouts(job_id)]
    took = time.monotonic() - started
    by_status = collections.Counter(r.status.value for r in rollouts)
    return {
        "rollouts": len(rollouts),
        "by_status": dict(sorted(by_status.items())),
        "ok_fraction": round(by_status.get("OK", 0) / max(len(rollouts), 1), 4),
        "job_s": round(took, 2),
        "longest_wait_s": round(max((r.metrics.get(metric, 0.0) for r in rollouts), default=0.0), 2),
    }


def _job(url: str, ids: list[str], group: int, concurrency: int, **policy: Any) -> JobSpec:
    return JobSpec(
        env=ENV,
        tasks=TaskSelection(kind="ids", ids=ids),
        group_size=group,
        policy=PolicyEndpoint(base_url=url, model="scripted", **policy),
        max_concurrency=concurrency,
    )


def _workload(rollouts: int, tasks: int) -> tuple[Script, list[str], int]:
    env = Registry.from_entry_points().get(ENV)
    chosen = list(env.tasks())[:tasks]
    return reference_script(env, chosen, latency_s=0.2), [t.id for t in chosen], max(1, rollouts // len(chosen))


# each side's outage wait: the default, and none (the behaviour before the wait)
SIDES = {"waited_out": 300.0, "no_wait": 0.0}


async def _alternated(rounds: int, one_job: Callable[[float], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """`one_job(wait_s)` for both sides `rounds` times, each first in turn: the last round's figures of each side,
    and each round's OK fractions."""
    figures: dict[str, dict[str, Any]] = {}
    fractions: dict[str, list[float]] = {side: [] for side in SIDES}
    for r in range(rounds):
        for side in list(SIDES) if r % 2 == 0 else list(reversed(SIDES)):
            figures[side] = await one_job(SIDES[side])
            fractions[side].append(figures[side]["ok_fraction"])
    return {**figures, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ok_fractions": fractions}


async def policy_outage(
    rollouts: int = 64, concurrency: int = 16, outage_s: float = 10.0, rounds: int = 2
) -> dict[str, Any]:
    """Both sides `rounds` times, each first in turn, on one server; the last round's figures, and each round's OK
    fractions."""
    script, ids, group = _workload(rollouts, 16)
    with tempfile.TemporaryDirectory(prefix="envfleet-outage-bench-") as tmp:
        orch = await create_server(
            OrchestratorConfig(
                port=0, data_dir=Path(tmp) / "data", backend=FakeBackendConfig(owner=OWNER), metrics_port=None
            )
        )
        try:
            async with EnvfleetClient(orch.address) as client:

                async def one_job(wait_s: float) -> dict[str, Any]:
                    server = await start_scripted_server(script)
                    port = server.port  # a closed server has none: it starts again on this one
                    back: list[ScriptedServer] = []

                    async def restart() -> None:
                        back.append(await start_scripted_server(script, port=port))

                    spec = _job(server.url, ids, group, concurrency, outage_wait_s=wait_s)
                    try:
                        return await _one_job(client, spec, Outage(server.close, restart), outage_s, "policy_outage_s")
                    finally:
                        for s in (server, *back):
                            await s.close()

                result = await _alternated(rounds, one_job)
        finally:
            await orch.stop(grace=1)
    return {
        **result,
        "outage_s": outage_s,
        "rollouts_per_job": len(ids) * group,
        "in_flight": concurrency,
        "note": "the policy double closed once a quarter of the job is done, started again outage_s later; "
        "waited_out: outage_wait_s 300 (the default), no_wait: 0 (before it)",
    }


async def engine_outage(
    rollouts: int = 16, concurrency: int = 2, outage_s: float = 40.0, rounds: int = 2
) -> dict[str, Any]:
    """Both sides `rounds` times, each first in turn, each on a server of its own; the last round's figures, and
    each round's OK fractions."""
    script, ids, group = _workload(rollouts, 16)
    policy = await start_scripted_server(script)

    async def one_job(wait_s: float) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="envfleet-engine-outage-bench-") as tmp:
            relay = EngineRelay(Path(tmp) / "engine.sock")
            try:
                await relay.up()
                config = OrchestratorConfig(
                    port=0,
                    data_dir=Path(tmp) / "data",
                    backend=DockerBackendConfig(owner=OWNER, base_url=relay.url, engine_outage_wait_s=wait_s),
                    pool=PoolConfig(enabled=False),
                    metrics_port=None,
                )
                orch = await create_server(config)
                try:
                    async with EnvfleetClient(orch.address) as client:
                        spec = _job(policy.url, ids, group, concurrency)
                        return await _one_job(client, spec, Outage(relay.down, relay.up), outage_s, "engine_outage_s")
                finally:
                    await relay.up()  # the server's stop removes what it holds through it
                    await orch.stop(grace=1)
            finally:
                await relay.close()

    try:
        result = await _alternated(rounds, one_job)
    finally:
        await policy.close()
    return {
        **result,
        "outage_s": outage_s,
        "rollouts_per_job": len(ids) * group,
        "in_flight": concurrency,
        "note": "real Docker, no warm pool; the engine's socket reached through a relay taken down once a quarter of "
        "the job is done and brought back outage_s later; waited_out: engine_outage_wait_s 300 (the default), "
        "no_wait: 0 (before it)",
    }


BENCHES = {"policy": ("policy_outage", policy_outage), "engine": ("engine_outage", engine_outage)}


def main() -> None:
    """Run one measurement alone and print it."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", nargs="?", choices=sorted(BENCHES), default="policy")
    p.add_argument("--rollouts", type=int, default=None, help="rollouts per job (policy 64, engine 16)")
    p.add_argument("--outage-s", type=float, default=None, help="seconds down (policy 10, engine 40)")
    p.add_argument("--out", type=Path, default=None, help="also set the figure in this results.json")
    args = p.parse_args()
    key, bench = BENCHES[args.which]
    given = {"rollouts": args.rollouts, "outage_s": args.outage_s}
    kwargs = {k: v for k, v in given.items() if v is not None}
    result = asyncio.run(bench(**kwargs))
    if args.out is not None:
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        results[key] = result
        args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
