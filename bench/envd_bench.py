"""envd's CPU per call: exec (`echo a`), reset and health through the real DockerBackend.

The CPU is read from the host in /proc/<envd pid>/stat: utime + stime + cutime + cstime, so envd's threads and the
children it reaped (the commands) count; envd is the container's PID 1 (State.Pid). Several
images (e.g. a baseline built from main and the current tree's) are measured in the same run, their rounds
interleaved in alternating order, because this host is shared and noisy: compare within one run only. Each image is
measured with each envd asked for (`--envd`; by default the compiled one and the Python one, both in every image).

    python -m bench.envd_bench                                   # the current tree's base image, both envds
    python -m bench.envd_bench --image envfleet/base:<old> --image envfleet/base:<new> --concurrency 1 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import docker

from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig, DockerSandbox
from orchestrator.core.sandbox import DETERMINISTIC_ENV, Limits, SandboxSpec
from orchestrator.images import ensure_base_image

HZ = os.sysconf("SC_CLK_TCK")
OPS: dict[str, Callable[[DockerSandbox], Awaitable[object]]] = {
    "exec": lambda sb: sb.exec("echo a"),
    "reset": lambda sb: sb.reset(""),
    "health": lambda sb: sb.transport.health(timeout=30),
}
# calls per sandbox and round at concurrency 1: enough clock ticks (10 ms) per measurement for ~2% resolution
CALLS = {"exec": 100, "reset": 100, "health": 400}


def cpu_s(pid: int) -> float:
    """utime + stime + cutime + cstime of `pid`, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / HZ


def envd_pid(api: Any, container_id: str) -> int:
    """envd's host pid: the container's PID 1 (State.Pid)."""
    return int(api.inspect_container(container_id)["State"]["Pid"])


@dataclass
class Group:
    """The sandboxes of one image with one envd, and their envd pids."""

    image: str  # the image and which envd: "envfleet/base:<hash> go"
    sandboxes: list[DockerSandbox]
    pids: list[int]


async def _measure(group: Group, op: str, calls: int) -> tuple[float, float]:
    """All sandboxes of `group` make `calls` sequential calls each, concurrently: (envd ms per call, calls/s)."""
    fn = OPS[op]

    async def one(sb: DockerSandbox) -> None:
        for _ in range(calls):
            await fn(sb)

    c0 = sum(cpu_s(p) for p in group.pids)
    t0 = time.monotonic()
    await asyncio.gather(*(one(sb) for sb in group.sandboxes))
    wall = time.monotonic() - t0
    n = calls * len(group.sandboxes)
    return (sum(cpu_s(p) for p in group.pids) - c0) / n * 1000, n / wall


async def bench(
    images: list[str], envds: list[str], concurrency: int, rounds: int, ops: list[str], scale: float
) -> dict[str, Any]:
    """Median envd CPU per call (ms) per image, envd and op, over `rounds` interleaved rounds."""
    owner = f"envfleet-envd-bench-{uuid.uuid4().hex[:8]}"
    backends = {e: await DockerBackend.start(DockerBackendConfig(owner=owner, envd=e)) for e in envds}  # type: ignore[arg-type]
    api = docker.from_env().api
    limits = Limits(memory_mb=128, cpus=0.5, pids=64, tmp_mb=16, workspace_mb=16)
    groups: list[Group] = []
    try:
        for image in images:
            spec = SandboxSpec(image=image, limits=limits, env=dict(DETERMINISTIC_ENV))
            for envd, backend in backends.items():
                sbs = list(await asyncio.gather(*(backend.create(spec) for _ in range(concurrency))))
                pids = [envd_pid(api, sb.id) for sb in sbs]  # type: ignore[attr-defined]
                groups.append(Group(f"{image} {envd}", sbs, pids))  # type: ignore[arg-type]
        await asyncio.sleep(1)
        per_call = max(2, round(scale * 1 / concurrency**0.5))
        samples: dict[tuple[str, str], list[float]] = {(g.image, op): [] for g in groups for op in ops}
        rates: dict[tuple[str, str], list[float]] = {k: [] for k in samples}
        for r in range(rounds):
            for op in ops:
                calls = max(2, round(CALLS[op] * per_call / 100))
                for g in groups if r % 2 == 0 else reversed(groups):
                    await _measure(g, op, 2)  # warm: the first call after another op pays for the switch
                    ms, rate = await _measure(g, op, calls)
                    samples[(g.image, op)].append(ms)
                    rates[(g.image, op)].append(rate)
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        return {
            "concurrency": concurrency,
            "rounds": rounds,
            "results": [
                {
                    "image": image,
                    "op": op,
                    "envd_cpu_ms_per_call": round(statistics.median(v), 3),
                    "min": round(min(v), 3),
                    "max": round(max(v), 3),
                    "calls_per_s": round(statistics.median(rates[(image, op)]), 1),
                }
                for (image, op), v in samples.items()
            ],
        }
    finally:
        for g in groups:
            await asyncio.gather(*(sb.close() for sb in g.sandboxes), return_exceptions=True)
        for backend in backends.values():
            await backend.close()


def main() -> None:
    """Parse arguments, run each concurrency, print a table and (with --out) write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", action="append", help="image to measure (repeat to compare); default: this tree's")
    ap.add_argument("--envd", action="append", choices=["go", "python"], help="envd to measure; default: both")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1], help="sandboxes calling at once, per image")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    ap.add_argument("--scale", type=float, default=100, help="percent of the default calls per measurement")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    images = args.image or [ensure_base_image(docker.from_env())]
    envds = args.envd or ["go", "python"]
    out = [asyncio.run(bench(images, envds, c, args.rounds, args.ops, args.scale)) for c in args.concurrency]
    for run in out:
        print(f"concurrency {run['concurrency']} per image, median of {run['rounds']} rounds")
        print(f"  {'image and envd':40} {'op':7} {'envd ms/call':>12} {'(min-max)':>15} {'calls/s':>8}")
        for row in run["results"]:
            spread = f"({row['min']:.2f}-{row['max']:.2f})"
            print(
                f"  {row['image']:40} {row['op']:7} {row['envd_cpu_ms_per_call']:12.3f} {spread:>15}"
                f" {row['calls_per_s']:8.1f}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
