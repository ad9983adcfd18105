"""The sandbox demo (until the orchestrator's job demo replaces it): one hardened sandbox, driven through envd."""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
from orchestrator.core.sandbox import SandboxSpec


def _short(value: Any) -> str:
    if hasattr(value, "name") and hasattr(value, "spec"):
        value = f"sandbox {value.name}"
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    text = str(value).strip().replace("\n", " | ")
    return text if len(text) <= 90 else text[:87] + "..."


async def run_demo(image: str, console: Console) -> None:
    """Create a sandbox, run commands and file operations through envd, print results and timings, destroy it."""
    backend = await DockerBackend.start(DockerBackendConfig(owner="envfleet-demo"))
    table = Table(title=f"envfleet sandbox demo ({image})")
    for col in ("step", "result", "ms"):
        table.add_column(col, justify="right" if col == "ms" else "left")

    async def step(name: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        t0 = time.perf_counter()
        out = await fn()
        table.add_row(name, _short(out), f"{(time.perf_counter() - t0) * 1000:.1f}")
        return out

    try:
        sandbox = await step("create (hardened, envd healthy)", lambda: backend.create(SandboxSpec(image=image)))
        try:
            await step("exec `id`", lambda: _stdout(sandbox.exec("id")))
            await step("exec `true`", lambda: _stdout(sandbox.exec(["true"])))
            await step("exec python3 -c", lambda: _stdout(sandbox.exec(["python3", "-c", "print(6 * 7)"])))
            await step("write_file app.py", lambda: sandbox.write_file("app.py", b"import sys; print(sys.argv)\n"))
            await step("read_file app.py", lambda: sandbox.read_file("app.py"))
            await step("exec app.py", lambda: _stdout(sandbox.exec(["python3", "app.py", "x"])))
            await step("upload tar (2 files)", lambda: sandbox.upload(_demo_tar(), "pkg"))
            await step("list_dir pkg", lambda: _names(sandbox.list_dir("pkg")))
            await step("exec with 1 s timeout", lambda: _summary(sandbox.exec("sleep 30", timeout=1)))
            await step(
                "exec `yes` capped at 1 KiB", lambda: _summary(sandbox.exec(["yes"], max_output=1024, timeout=1))
            )
            await step("write to / (read-only)", lambda: _summary(sandbox.exec("touch /etc/x")))
            await step("network interfaces", lambda: _stdout(sandbox.exec("ls /sys/class/net")))
        finally:
            await step("destroy", sandbox.close)
    finally:
        await backend.close()
    console.print(table)


async def _stdout(coro: Awaitable[Any]) -> bytes:
    r = await coro
    return bytes(r.stdout)


async def _summary(coro: Awaitable[Any]) -> str:
    r = await coro
    flags = [f for f in ("timed_out", "truncated", "oom_killed") if getattr(r, f)]
    return f"exit {r.exit_code} {' '.join(flags)} {len(r.stdout)}B out, {r.stderr.decode(errors='replace')[:60]}"


async def _names(coro: Awaitable[Any]) -> str:
    return ", ".join(f"{e.name} ({e.kind})" for e in await coro)


def _demo_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("a.txt", b"alpha\n"), ("b/c.txt", b"gamma\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
