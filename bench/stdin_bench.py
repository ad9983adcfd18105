"""Streamed Exec stdin: the server's memory while 8 ExecStreams push 50 MiB of stdin each (issue 10's case, which
took the server from 100 MiB to 1.6 GiB when stdin came whole in the request)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from orchestrator.backends.docker.backend import DockerBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.server.app import OrchestratorConfig, create_server
from protos import orchestrator_pb2 as pb

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent

# the trainer runs in its own process, so that only the server's memory is measured
_TRAINER = """
import asyncio, sys
from orchestrator.client.sdk import EnvfleetClient
from protos import orchestrator_pb2 as pb

async def main(address, sid, n, size):
    async with EnvfleetClient(address) as c:
        async def one():
            async def inputs():
                yield pb.ExecInput(request=pb.ExecRequest(sandbox_id=sid, shell="wc -c", timeout_s=600))
                for _ in range(size >> 20):
                    yield pb.ExecInput(stdin=b"s" * (1 << 20))
            return b"".join([ev.stdout async for ev in c.sandbox_stub.ExecStream(inputs())]).decode().strip()
        got = await asyncio.gather(*(one() for _ in range(n)))
        assert got == [str(size)] * n, got

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def streamed_stdin(image: str, n: int = 8, size: int = 50 * MiB) -> dict[str, Any]:
    """RSS of an in-process server before and at its peak while `n` ExecStreams of `size` bytes each run."""
    with tempfile.TemporaryDirectory() as data_dir:
        config = OrchestratorConfig(
            port=0, data_dir=Path(data_dir), backend=DockerBackendConfig(owner="envfleet-bench")
        )
        orch = await create_server(config)
        try:
            async with EnvfleetClient(orch.address) as c:
                sid = (await c.sandbox_stub.Create(pb.CreateSandboxRequest(image=image))).sandbox_id
                before = peak = _rss()

                async def sample() -> None:
                    nonlocal peak
                    while True:
                        peak = max(peak, _rss())
                        await asyncio.sleep(0.005)

                sampler = asyncio.create_task(sample())
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", _TRAINER, orch.address, sid, str(n), str(size), cwd=REPO
                )
                rc = await proc.wait()
                seconds = loop.time() - t0
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
                await c.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))
        finally:
            await orch.stop()
    if rc != 0:
        raise RuntimeError(f"the streaming trainer failed (exit {rc})")
    return {
        "execs": n,
        "stdin_mib_each": size // MiB,
        "server_rss_before_mib": round(before / MiB, 1),
        "server_rss_peak_mib": round(peak / MiB, 1),
        "growth_mib": round((peak - before) / MiB, 1),
        "mib_per_s": round(n * size / MiB / seconds, 1),
        "before_streaming": "unary Exec, no caps: 100 MiB -> 1.6 GiB (issue 10)",
    }


if __name__ == "__main__":
    out = REPO / "bench" / "results.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    import docker

    from orchestrator.images import ensure_base_image

    results["exec_stdin_streamed"] = asyncio.run(streamed_stdin(ensure_base_image(docker.from_env())))
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps(results["exec_stdin_streamed"], indent=2))
