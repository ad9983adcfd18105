"""The scripted policy server's own cost: throughput, latency and CPU per chat completion.

The scale bench (256 rollouts in synchronized 1 s waves) sees every millisecond the policy server spends per request,
so this measures the server alone, in its subprocess mode, over loopback:

1. throughput: C connections each sending chat completions back to back for D seconds (latency 0), through a raw
   keep-alive HTTP/1.1 client (cheap, so the server is the bottleneck) and through the rollout runner's own client
   (OpenAIPolicy: on aiohttp now, httpx in the table below); requests/s, p50/p99 latency, and server CPU seconds
   per request (/proc/PID/stat).
2. waves: W waves of C simultaneous requests with latency_s=1, as bench/scale sends them; how far past 1 s a wave ends.

    python -m bench.policy_server [--module orchestrator.testing.scripted_policy] [--clients 256] [--seconds 5]

--module names any module with the scripted policy's CLI, so two implementations can be compared in one run.

Measured 2026-12-01 on the 2-core dev host while other test suites ran (load average 10-20, so wall-clock figures
are noisy; server CPU per request is the steady one), 256 clients, 3 rounds, medians, against the hand-written asyncio
HTTP/1.1 server this replaced (commit 71ffbc9) and the same ASGI app on uvicorn's pure-Python h11:

    server CPU ms/request      raw client   httpx client   1 s waves     raw client req/s, p50/p99 ms
    hand-written asyncio       1.10         1.08           1.43          306, 726/1008
    uvicorn + httptools        0.82         1.06           1.37          362, 443/1023
    uvicorn + h11              1.02         1.46           1.24          273, 913/1847

An earlier single round at load ~8: hand-written 0.79 / 0.88 / 0.96, uvicorn + httptools 0.63 / 0.75 / 0.91,
h11 0.78 / 0.98 / 1.11. So uvicorn with httptools costs no more than the hand-written server (about 20% less with a
cheap client), which is why httptools is a dependency; a 1 s wave of 256 requests spends ~0.3 s of one core in
the server either way, and the rest of a wave's overhead here is the httpx client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy.client import OpenAIPolicy

TICK = os.sysconf("SC_CLK_TCK")
SCRIPT = {
    "default": [
        {"content": "Let me look.", "tool_calls": [{"name": "bash", "arguments": {"cmd": "ls -la /workspace"}}]},
        {"tool_calls": [{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}]},
        {"tool_calls": [{"name": "submit", "arguments": {"answer": "45"}}]},
    ]
}
# the third turn of a python-tool style episode: system, task, two assistant turns with their tool results
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful engineer. Use the tools; submit the answer. " * 4},
    {"role": "user", "content": "What is the sum of the integers 0 to 9? Show your work with the python tool. " * 3},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "call_0_0", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls -la"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0_0", "content": "total 0\ndrwxr-xr-x 2 user user 40 . \n" * 4},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1_0",
                "type": "function",
                "function": {"name": "python", "arguments": '{"code": "print(sum(range(10)))"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1_0", "content": "45\n"},
]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


async def _start(module: str, script: dict[str, Any], tmp: Path) -> tuple[asyncio.subprocess.Process, str]:
    path = tmp / f"script-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(script))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, "--script", str(path), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
    if not line.startswith("listening "):
        proc.kill()
        raise RuntimeError(f"{module} did not start: {line!r}")
    return proc, line.split()[1]


async def _stop(proc: asyncio.subprocess.Process) -> None:
    proc.terminate()
    await asyncio.wait_for(proc.wait(), 30)


def _body(policy: OpenAIPolicy, i: int) -> dict[str, Any]:
    return policy.request_body(MESSAGES, [], Sampling(), user=f"bench:task-{i}:0")


class _RawConnection:
    """One keep-alive HTTP/1.1 connection that posts a fixed body and reads the response; nothing else."""

    def __init__(self, url: str, body: bytes) -> None:
        hostport = url.split("//", 1)[1].split("/", 1)[0]
        self.host, port = hostport.rsplit(":", 1)
        self.port = int(port)
        self.request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self) -> int:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(self.request)
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _closed_loop(
    clients: int, seconds: float, make: Callable[[int], Callable[[], Awaitable[None]]]
) -> list[float]:
    """Each client sends requests back to back until the deadline; the latency of every request."""
    deadline = time.monotonic() + seconds
    latencies: list[float] = []

    async def client(i: int) -> None:
        post = make(i)
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            await post()
            latencies.append(time.monotonic() - t0)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return latencies


def _summary(latencies: list[float], wall_s: float, cpu_s: float) -> dict[str, float]:
    q = statistics.quantiles(latencies, n=100)
    return {
        "requests": len(latencies),
        "requests_per_s": round(len(latencies) / wall_s, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
        "server_cpu_ms_per_request": round(cpu_s / len(latencies) * 1000, 3),
    }


async def _throughput(module: str, clients: int, seconds: float, tmp: Path, raw: bool) -> dict[str, float]:
    proc, url = await _start(module, SCRIPT, tmp)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, request_timeout_s=120, max_retries=0))
    conns: list[_RawConnection] = []
    try:
        await policy.complete(MESSAGES, [], Sampling(), user="bench:warm:0")  # first request: imports, JIT-less warmup

        def make(i: int) -> Callable[[], Awaitable[None]]:
            if raw:
                conn = _RawConnection(url, json.dumps(_body(policy, i)).encode())
                conns.append(conn)

                async def post_raw() -> None:
                    if await conn.post() != 200:
                        raise RuntimeError("the server did not answer 200")

                return post_raw

            async def post_httpx() -> None:
                await policy.complete(MESSAGES, [], Sampling(), user=f"bench:task-{i}:0")

            return post_httpx

        cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
        latencies = await _closed_loop(clients, seconds, make)
        wall, cpu = time.monotonic() - t0, _cpu_s(proc.pid) - cpu0
    finally:
        for c in conns:
            c.close()
        await policy.aclose()
        await _stop(proc)
    return _summary(latencies, wall, cpu)


async def _waves(module: str, clients: int, waves: int, tmp: Path) -> dict[str, float]:
    proc, url = await _start(module, {**SCRIPT, "latency_s": 1.0}, tmp)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, request_timeout_s=120, max_retries=0))
    try:
        overheads: list[float] = []
        cpu0 = _cpu_s(proc.pid)
        for _ in range(waves):
            t0 = time.monotonic()
            await asyncio.gather(
                *(policy.complete(MESSAGES, [], Sampling(), user=f"bench:task-{i}:0") for i in range(clients))
            )
            overheads.append(time.monotonic() - t0 - 1.0)
        cpu = _cpu_s(proc.pid) - cpu0
    finally:
        await policy.aclose()
        await _stop(proc)
    return {
        "waves": waves,
        "wave_overhead_ms_median": round(statistics.median(overheads) * 1000, 1),
        "wave_overhead_ms_max": round(max(overheads) * 1000, 1),
        "server_cpu_ms_per_request": round(cpu / (waves * clients) * 1000, 3),
    }


def _median(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(s[k] for s in samples), 3) for k in samples[0]}


async def run(modules: list[str], clients: int, seconds: float, waves: int, rounds: int) -> dict[str, Any]:
    """Every measurement for every module, interleaved (and repeated `rounds` times, medians kept) so that load from
    elsewhere on the host hits them alike."""
    phases: dict[str, Callable[[str, Path], Awaitable[dict[str, float]]]] = {
        "raw_client": lambda m, tmp: _throughput(m, clients, seconds, tmp, raw=True),
        "httpx_client": lambda m, tmp: _throughput(m, clients, seconds, tmp, raw=False),
        "waves_1s": lambda m, tmp: _waves(m, clients, waves, tmp),
    }
    samples: dict[str, dict[str, list[dict[str, float]]]] = {m: {p: [] for p in phases} for m in modules}
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            for phase, measure in phases.items():
                for m in modules if r % 2 == 0 else modules[::-1]:  # each module first in turn
                    samples[m][phase].append(await measure(m, Path(d)))
    results = {m: {p: _median(s) for p, s in by_phase.items()} for m, by_phase in samples.items()}
    return {
        "clients": clients,
        "seconds": seconds,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": results,
    }


def main() -> None:
    """Run the measurements and print them as JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.policy_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--module", action="append", help="a scripted policy CLI module (repeatable)")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--waves", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1, help="repeat everything; report medians (for a noisy host)")
    args = p.parse_args()
    modules = args.module or ["orchestrator.testing.scripted_policy"]
    print(json.dumps(asyncio.run(run(modules, args.clients, args.seconds, args.waves, args.rounds)), indent=2))


if __name__ == "__main__":
    main()
