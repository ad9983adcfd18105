"""`make bench`: envfleet against baselines measured on the same host in the same run; writes bench/results.json.

The sandbox figures here (exec, cold start, the docker-exec transport) are p50s over at least 20 runs, interleaved
with their baseline, each side first in turn, so that the noise of a shared machine hits both alike, and reported as
a ratio; each bench module's docstring says how its own figures are taken (some, like orchestrator_overhead and
group_snapshot, are one timed job a side). The file is written after each bench, and `meta.written` names the keys
this run wrote: a key it does not name is an earlier run's, dated in its own note.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import docker

from bench.fleet_bench import run_all as fleet_run_all
from bench.freeze_bench import idle_frozen
from bench.orchestrator_bench import orchestrator_overhead, stream_throughput
from bench.outage_bench import engine_outage, policy_outage
from bench.scale_bench import group_snapshot, orchestrator_overhead_recycled, warm_and_recycle
from bench.stdin_bench import streamed_stdin
from bench.swe_bench import swe_eval_throughput
from bench.tito_bench import tito_overhead
from bench.tracing_bench import run as tracing_run
from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig, DockerSandbox
from orchestrator.backends.docker.startup import ENVD_COMMANDS
from orchestrator.core.runtime import tune_gc
from orchestrator.core.sandbox import Sandbox, SandboxSpec
from orchestrator.images import ensure_base_image

# how envd's command line starts in a sandbox (what `ps` shows before its socket): the compiled envd, or the Python one
ENVD_STARTS = tuple(" ".join(cmd[: cmd.index("--socket")]) for cmd in ENVD_COMMANDS.values())

log = logging.getLogger("bench")


def p50(xs: list[float]) -> float:
    """Median in milliseconds, rounded for the report."""
    return round(statistics.median(xs) * 1000, 3)


def pair(envfleet: list[float], baseline: list[float]) -> dict[str, Any]:
    """The shape every ratio key of results.json has."""
    e, b = p50(envfleet), p50(baseline)
    return {"envfleet_p50_ms": e, "baseline_p50_ms": b, "ratio": round(e / b, 4), "runs": len(envfleet)}


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def _true_vs_exec_run(sandbox: Sandbox, container: Any, runs: int) -> dict[str, Any]:
    """`true` through the sandbox's transport against the SDK's exec_run on the same container."""
    ours: list[float] = []
    base: list[float] = []
    # alternate blocks of 10, so the engine's after-work from a `docker exec` does not land inside ours
    for _ in range(0, runs, 10):
        for _ in range(10):
            ours.append(await timed(lambda: sandbox.exec(["true"])))
        for _ in range(10):
            t0 = time.perf_counter()
            container.exec_run("true", user="99999:99999")
            base.append(time.perf_counter() - t0)
    return pair(ours, base)


async def bench_exec(backend: DockerBackend, client: docker.DockerClient, image: str, runs: int) -> dict[str, Any]:
    """exec of `true` through envd against the SDK's exec_run on the same container."""
    async with await backend.create(SandboxSpec(image=image)) as s:
        assert isinstance(s, DockerSandbox)
        container = client.containers.get(s.id)
        for _ in range(5):  # warm both paths
            await s.exec(["true"])
            container.exec_run("true", user="99999:99999")
        return await _true_vs_exec_run(s, container, runs)


async def bench_docker_exec_transport(
    backend: DockerBackend, client: docker.DockerClient, image: str, runs: int
) -> dict[str, Any]:
    """The fallback transport (`docker exec`) against the bare SDK exec_run: what the fallback costs on top."""
    async with await backend.create(SandboxSpec(image=image, transport="docker-exec")) as s:
        container = client.containers.get(s.id)
        return await _true_vs_exec_run(s, container, runs)


async def bench_cold_start(
    backend: DockerBackend, client: docker.DockerClient, image: str, runs: int
) -> dict[str, Any]:
    """Hardened create until the first exec is possible, against `docker run --rm IMAGE true` through the SDK."""
    ours: list[float] = []
    base: list[float] = []
    client.containers.run(image, ["true"], remove=True, network_mode="none")  # warm the image

    async def envfleet() -> None:
        t0 = time.perf_counter()
        s = await backend.create(SandboxSpec(image=image))
        ours.append(time.perf_counter() - t0)
        await s.close()

    async def baseline() -> None:
        t0 = time.perf_counter()
        client.containers.run(image, ["true"], remove=True, network_mode="none")
        base.append(time.perf_counter() - t0)

    for r in range(runs):  # each side first in turn
        for side in (envfleet, baseline) if r % 2 == 0 else (baseline, envfleet):
            await side()
    return pair(ours, base)


def _smaps_rollup(pid: int) -> dict[str, int]:
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return fields


async def bench_envd_memory(backend: DockerBackend, client: docker.DockerClient, image: str) -> dict[str, float]:
    """envd's unique (private) and resident memory in idle sandboxes, from the host's /proc.

    Several sandboxes run at once: the interpreter's code pages are then shared between their envds (one page
    cache under overlayfs), and what remains private is what each extra sandbox really costs.
    """
    sandboxes = await asyncio.gather(*(backend.create(SandboxSpec(image=image)) for _ in range(4)))
    try:
        for s in sandboxes:
            await s.exec(["true"])
        await asyncio.sleep(1)
        uss, rss = [], []
        for s in sandboxes:
            top = client.api.top(s.id, ps_args="-eo pid,args")
            pid = next(int(p[0]) for p in top["Processes"] if p[1].startswith(ENVD_STARTS))
            f = _smaps_rollup(pid)
            uss.append((f["Private_Clean"] + f["Private_Dirty"]) / 1024)
            rss.append(f["Rss"] / 1024)
        return {"envd_uss_mb": round(statistics.median(uss), 2), "envd_rss_mb": round(statistics.median(rss), 2)}
    finally:
        await asyncio.gather(*(s.close() for s in sandboxes))


def host_spawn_p50(runs: int) -> float:
    """The physical floor: fork+exec of /bin/true from Python on the host."""
    xs = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(["/bin/true"], check=True)
        xs.append(time.perf_counter() - t0)
    return p50(xs)


async def main_async(out: Path, runs: int) -> dict[str, Any]:
    tune_gc()  # the benches' control planes run in this process: tuned as `envfleet serve` tunes it
    client = docker.from_env()
    image = ensure_base_image(client)
    backend = await DockerBackend.start(DockerBackendConfig(owner="envfleet-bench"))
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results["meta"] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "cpus": __import__("os").cpu_count(),
        "docker": client.version().get("Version"),
        "image": image,
        "written": [],
    }

    def keep(figures: dict[str, Any]) -> None:
        """Take a bench's figures, and write the file: a bench that fails later loses none of them."""
        results.update(figures)
        results["meta"]["written"] = sorted({*results["meta"]["written"], *figures})
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        tmp.replace(out)

    try:
        keep({"exec_roundtrip": await bench_exec(backend, client, image, max(runs, 50))})
        keep({"docker_exec_transport": await bench_docker_exec_transport(backend, client, image, runs)})
        keep({"sandbox_cold_start": await bench_cold_start(backend, client, image, runs)})
        keep(await bench_envd_memory(backend, client, image))
        keep({"host_spawn_p50_ms": host_spawn_p50(50)})
    finally:
        await backend.close()
    keep({"exec_stdin_streamed": await streamed_stdin(image)})
    keep({"idle_frozen": await idle_frozen()})
    keep({"orchestrator_overhead": await orchestrator_overhead(image, total=48, concurrency=8)})
    keep({"stream_throughput": await stream_throughput(20_000)})
    keep(await warm_and_recycle(image, runs))
    keep({"orchestrator_overhead_recycled": await orchestrator_overhead_recycled(image)})
    keep({"group_snapshot": await group_snapshot(8)})
    keep({"swe_eval_throughput": await swe_eval_throughput()})
    keep({"fleet": await fleet_run_all()})
    keep({"tracing": await tracing_run()})
    keep({"tito_overhead": await tito_overhead(tasks=16, rounds=7)})
    keep({"policy_outage": await policy_outage()})
    keep({"engine_outage": await engine_outage()})
    return results


def main() -> None:
    """Run the sandbox benchmarks and print the report."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("bench/results.json"))
    p.add_argument("--runs", type=int, default=30, help="samples per figure (at least 20)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = asyncio.run(main_async(args.out, max(args.runs, 20)))
    print(json.dumps(results, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
