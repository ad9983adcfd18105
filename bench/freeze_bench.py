"""Idle sandboxes, frozen against running (`idle_frozen` in bench/results.json), side by side in one run.

N sandboxes sit idle, running then frozen, in alternating rounds: the CPU of their envds (every thread's time on a
CPU, from /proc/<pid>/task/*/schedstat) and of their containerd shims (outside the container, so frozen or not)
per second per sandbox. Then what a hand-out from the frozen pool adds: a thaw and the first exec, against an exec
in a sandbox that was never frozen.

    python -m bench.freeze_bench
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
import uuid
from typing import Any

import docker

from bench.envd_bench import envd_pid
from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig, DockerSandbox
from orchestrator.core.sandbox import DETERMINISTIC_ENV, Limits, SandboxSpec
from orchestrator.images import ensure_base_image


def threads_cpu_s(pid: int) -> float:
    """Every thread of `pid`: its time on a CPU, in seconds (schedstat: exact, not sampled at clock ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


async def _idle(pids: list[int], seconds: float) -> float:
    """ms of CPU per second per process over `seconds` of idling."""
    before, t0 = sum(threads_cpu_s(p) for p in pids), time.monotonic()
    await asyncio.sleep(seconds)
    return (sum(threads_cpu_s(p) for p in pids) - before) / (time.monotonic() - t0) / len(pids) * 1000


async def _first_exec_ms(sb: DockerSandbox, thaw: bool) -> float:
    if thaw:
        assert sb.freeze()
        await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    sb.thaw()
    await sb.exec(["true"])
    return (time.perf_counter() - t0) * 1000


async def idle_frozen(n: int = 32, rounds: int = 3, seconds: float = 8.0) -> dict[str, Any]:
    """Idle CPU per sandbox running and frozen (medians of `rounds`), and a hand-out's first exec, thawed or not."""
    backend = await DockerBackend.start(DockerBackendConfig(owner=f"envfleet-freeze-bench-{uuid.uuid4().hex[:8]}"))
    api = docker.from_env().api
    limits = Limits(memory_mb=128, cpus=0.5, pids=64, tmp_mb=16, workspace_mb=16)
    spec = SandboxSpec(image=ensure_base_image(docker.from_env()), limits=limits, env=dict(DETERMINISTIC_ENV))
    sandboxes = list(await asyncio.gather(*(backend.create(spec) for _ in range(n))))
    try:
        envds = [envd_pid(api, sb.id) for sb in sandboxes]
        shims = sorted({_parent(api.inspect_container(sb.id)["State"]["Pid"]) for sb in sandboxes})
        await asyncio.sleep(2)
        figures: dict[str, list[float]] = {f"{p}_{s}": [] for p in ("envd", "shim") for s in ("running", "frozen")}
        for r in range(rounds):
            for state in ("running", "frozen") if r % 2 == 0 else ("frozen", "running"):
                for sb in sandboxes:
                    if state == "frozen":
                        assert sb.freeze(), "this host's cgroup freezer cannot be written"
                    else:
                        sb.thaw()
                await asyncio.sleep(0.5)
                envd, shim = await asyncio.gather(_idle(envds, seconds), _idle(shims, seconds))
                figures[f"envd_{state}"].append(envd)
                figures[f"shim_{state}"].append(shim)
        for sb in sandboxes:
            sb.thaw()
        first: dict[str, list[float]] = {"thawed": [], "warm": []}
        for i in range(20):
            for kind in ("thawed", "warm") if i % 2 == 0 else ("warm", "thawed"):
                first[kind].append(await _first_exec_ms(sandboxes[i % n], kind == "thawed"))
        med = {k: statistics.median(v) for k, v in figures.items()}
        return {
            "sandboxes": n,
            "rounds": rounds,
            "envd_idle_ms_per_s_running": round(med["envd_running"], 3),
            "envd_idle_ms_per_s_frozen": round(med["envd_frozen"], 3),
            "shim_idle_ms_per_s_running": round(med["shim_running"], 3),
            "shim_idle_ms_per_s_frozen": round(med["shim_frozen"], 3),
            "first_exec_p50_ms_thawed": round(statistics.median(first["thawed"]), 2),
            "first_exec_p50_ms_warm": round(statistics.median(first["warm"]), 2),
        }
    finally:
        await asyncio.gather(*(sb.close() for sb in sandboxes), return_exceptions=True)
        await backend.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(idle_frozen()), indent=2))
