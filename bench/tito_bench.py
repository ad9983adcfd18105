"""`tito_overhead`: the orchestrator's CPU per policy turn in tito mode against chat mode, on the same episodes.

The same 6-turn python-tool episodes run in both modes through one in-process orchestrator (real gRPC, jobs, store
and stream; the fake backend, so no Docker time blurs the figure) against the qwen3 model double in a process of its
own, so the double's templating and sampling are not counted. Jobs alternate chat, tito, chat, tito... and each
job's CPU is this process's `time.process_time` across it, over the assistant turns it ran. The tokenizer is loaded
before measuring (once per process in production too). Chat's rollouts arrive `inconsistent` with this template
(their arrays dropped); tito's carry complete arrays, whose storing and streaming are part of what tito costs.

    python -m bench.tito_bench [--tasks 16] [--rounds 7] [--out bench/results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, Rollout, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.server.app import OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.testing.qwen_like import QWEN_LIKE_DIR
from orchestrator.testing.scripts import long_script

ENV = "python-tool"
OWNER = "envfleet-bench-tito"
TURNS = 6


async def _start_double(script_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchestrator.testing.scripted_policy",
        "--script",
        str(script_path),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
    if not line.startswith("listening "):
        proc.kill()
        raise RuntimeError(f"the policy double did not start: {line!r}")
    return proc, line.split()[1]


def _job(ids: list[str], url: str, mode: str, concurrency: int) -> JobSpec:
    tokenizer = QWEN_LIKE_DIR.name if mode == "tito" else ""
    return JobSpec(
        env=ENV,
        tasks=TaskSelection(kind="ids", ids=ids),
        policy=PolicyEndpoint(base_url=url, model="qwen-like", tokenizer=tokenizer),
        token_mode=mode,  # type: ignore[arg-type]
        max_turns=TURNS + 2,
        max_concurrency=concurrency,
        max_infra_retries=0,
    )


async def _measured(client: EnvfleetClient, job: JobSpec) -> tuple[float, int, list[Rollout]]:
    cpu0 = time.process_time()
    rollouts = [r async for r in client.rollouts(await client.submit(job))]
    cpu = time.process_time() - cpu0
    return cpu, sum(1 for r in rollouts for t in r.turns if t.role == "assistant"), rollouts


async def tito_overhead(tasks: int = 16, rounds: int = 7, concurrency: int = 8) -> dict[str, Any]:
    """CPU per turn, tito over chat, p50 over `rounds` alternating pairs of jobs of `tasks` 6-turn episodes."""
    env = Registry.from_entry_points().get(ENV)
    chosen = list(env.tasks())[:tasks]
    ids = [t.id for t in chosen]
    with tempfile.TemporaryDirectory(prefix="envfleet-tito-bench-") as tmp:
        script = Path(tmp) / "script.json"
        script.write_text(long_script(env, chosen, turns=TURNS).model_dump_json())
        proc, url = await _start_double(script)
        per_turn: dict[str, list[float]] = {"chat": [], "tito": []}
        statuses: dict[str, set[str]] = {"chat": set(), "tito": set()}
        try:  # the double stops whatever fails, the server's start too
            orch = await create_server(
                OrchestratorConfig(
                    port=0,
                    data_dir=Path(tmp) / "data",
                    backend=FakeBackendConfig(owner=OWNER),
                    tokenizer_dirs=[QWEN_LIKE_DIR.parent],
                    metrics_port=None,
                )
            )
            try:
                async with EnvfleetClient(orch.address) as client:
                    for mode in ("chat", "tito"):  # warm up: connections, the tokenizer load, the template caches
                        await _measured(client, _job(ids[:2], url, mode, concurrency))
                    for r in range(rounds):
                        for mode in ("chat", "tito") if r % 2 == 0 else ("tito", "chat"):  # each first in turn
                            cpu, turns, rollouts = await _measured(client, _job(ids, url, mode, concurrency))
                            per_turn[mode].append(cpu / max(turns, 1))
                            statuses[mode] |= {r.tokens.status for r in rollouts}
            finally:
                await orch.stop(grace=1)
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
    chat, tito = statistics.median(per_turn["chat"]), statistics.median(per_turn["tito"])
    return {
        "tito_cpu_per_turn_ms": round(tito * 1000, 3),
        "chat_cpu_per_turn_ms": round(chat * 1000, 3),
        "ratio": round(tito / chat, 4),
        "target": 1.3,
        "rounds": rounds,
        "episodes_per_job": tasks,
        "turns_per_episode": TURNS,
        "token_status": {k: sorted(v) for k, v in statuses.items()},
    }


def main() -> None:
    """Run the measurement alone and print it."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="also set `tito_overhead` in this results.json")
    args = p.parse_args()
    result = asyncio.run(tito_overhead(args.tasks, args.rounds))
    if args.out is not None:
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        results["tito_overhead"] = result
        args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
