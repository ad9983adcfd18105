"""Orchestrator benchmarks: rollouts/s against a plain docker SDK loop, and stream throughput from the result log."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import docker

from orchestrator.backends.docker.backend import DockerBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Environment, Rubric, ScoringContext, Task, ToolInvocation
from orchestrator.core.models import JobSpec, JobState, Rollout, RolloutStatus, TaskSelection, Turn
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.server.app import OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.service.store import ResultStore
from orchestrator.testing.demo import start_orchestrator_process
from orchestrator.testing.scripted_policy import start_scripted_server
from orchestrator.testing.scripts import reference_script

COMMANDS = ("echo one", "echo two")


def _submitted_ok(ctx: ScoringContext) -> float:
    return float(ctx.episode.answer == "ok")


class TrivialEnv(Environment):
    """Three policy turns: two bash calls and a submit. Nothing to compute: what is measured is the machinery."""

    name = "bench-trivial"
    version = "1"
    tools = ("bash", "submit")
    max_turns = 3
    rubric = Rubric([("submitted_ok", _submitted_ok, 1.0)])

    def __init__(self, count: int = 1000) -> None:
        self._tasks = tuple(
            Task(
                id=f"t{i:04d}",
                prompt="run two commands and submit ok",
                reference=(
                    *(ToolInvocation("bash", {"command": c}) for c in COMMANDS),
                    ToolInvocation("submit", {"answer": "ok"}),
                ),
            )
            for i in range(count)
        )

    def tasks(self) -> Sequence[Task]:
        return self._tasks


@asynccontextmanager
async def bench_orchestrator(
    env: Environment, concurrency: int, owner: str = "envfleet-bench"
) -> AsyncIterator[tuple[EnvfleetClient, str]]:
    """An in-process orchestrator serving only `env`, a scripted policy replaying its references, and a client."""
    registry = Registry()
    registry.register(env)
    policy = await start_scripted_server(reference_script(env))
    with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as data:
        orch = await create_server(
            OrchestratorConfig(
                port=0, data_dir=Path(data), max_in_flight=concurrency, backend=DockerBackendConfig(owner=owner)
            ),
            registry=registry,
        )
        try:
            async with EnvfleetClient(orch.address) as client:
                yield client, policy.url
        finally:
            await orch.stop()
            await policy.close()


async def orchestrator_rollouts_per_s(image_ready: str, total: int, concurrency: int, owner: str) -> float:
    """Rollouts/s through the whole orchestrator (gRPC, scheduler, envd, scoring, result log, stream)."""
    env = TrivialEnv(total)
    async with bench_orchestrator(env, concurrency, owner) as (client, url):
        spec = JobSpec(env=env.name, policy=PolicyEndpoint(base_url=url), max_concurrency=concurrency)
        # warm: the image resolve and the first create are not part of the steady state
        warm = await client.submit(spec.model_copy(update={"tasks": TaskSelection(kind="ids", ids=["t0000"])}))
        [r async for r in client.rollouts(warm)]
        t0 = time.perf_counter()
        job_id = await client.submit(spec)
        got = [r async for r in client.rollouts(job_id)]
        elapsed = time.perf_counter() - t0
    bad = [r for r in got if r.status != RolloutStatus.OK or r.reward != 1.0]
    if bad or len(got) != total:
        raise RuntimeError(f"benchmark rollouts failed: {len(bad)} bad of {len(got)}: {bad[:1]}")
    return total / elapsed


def baseline_rollouts_per_s(image: str, total: int, concurrency: int) -> float:
    """The same episodes with the docker SDK directly: run, exec_run per tool call, remove."""
    client = docker.from_env(max_pool_size=concurrency * 2)
    lock = threading.Lock()
    left = [total]

    def worker() -> None:
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            c = client.containers.run(
                image,
                ["sleep", "infinity"],
                detach=True,
                network_mode="none",
                init=True,
                user="99999:99999",
                labels={"envfleet.bench": "baseline"},
            )
            try:
                for cmd in COMMANDS:
                    r = c.exec_run(["bash", "-c", cmd])
                    assert r.exit_code == 0
            finally:
                c.remove(force=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return total / (time.perf_counter() - t0)


async def orchestrator_overhead(image: str, total: int = 48, concurrency: int = 8) -> dict[str, Any]:
    """Both figures and their ratio (envfleet / baseline), measured back to back."""
    ours = await orchestrator_rollouts_per_s(image, total, concurrency, "envfleet-bench")
    base = await asyncio.to_thread(baseline_rollouts_per_s, image, total, concurrency)
    return {
        "envfleet_rollouts_per_s": round(ours, 3),
        "baseline_rollouts_per_s": round(base, 3),
        "ratio": round(ours / base, 3),
        "rollouts": total,
        "concurrency": concurrency,
    }


def _small_rollout(job_id: str, i: int) -> Rollout:
    return Rollout(
        id=f"{job_id}:t{i}:0",
        job_id=job_id,
        env="python-tool@1",
        task_id=f"t{i}",
        group_id=f"{job_id}:t{i}",
        sample_index=0,
        status=RolloutStatus.OK,
        reward=1.0,
        reward_components={"exact_match": 1.0},
        turns=[Turn(role="user", text="2+2?"), Turn(role="assistant", text="4")],
    )


async def stream_throughput(total: int = 20_000) -> dict[str, Any]:
    """Rollouts/s delivered from the result log to the Python SDK's iterator (auto-ack on), small trajectories."""
    with tempfile.TemporaryDirectory(prefix="envfleet-bench-") as data:
        store = await ResultStore.open(Path(data) / "results.sqlite3")
        job_id = "benchstream"
        spec = JobSpec(env="python-tool", policy=PolicyEndpoint(base_url="http://127.0.0.1:9/v1"))
        await store.create_job(job_id, spec, total)
        for i in range(total):
            await store.append(_small_rollout(job_id, i))
        await store.set_job_state(job_id, JobState.COMPLETED)
        await store.close()
        # the orchestrator runs in its own process, as it does for a real trainer
        proc, address = await start_orchestrator_process(Path(data), "envfleet-bench")
        try:
            async with EnvfleetClient(address) as client:
                t0 = time.perf_counter()
                n = 0
                async for _ in client.rollouts(job_id, max_in_flight=4096, max_batch=512):
                    n += 1
                elapsed = time.perf_counter() - t0
        finally:
            proc.terminate()
            await proc.wait()
    if n != total:
        raise RuntimeError(f"streamed {n} of {total}")
    return {"rollouts_per_s": round(total / elapsed, 1), "rollouts": total}
