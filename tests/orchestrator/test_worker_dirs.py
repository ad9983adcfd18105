"""The worker socket directory of `envfleet serve` (real subprocesses): a clean stop removes it; a control plane
killed with SIGKILL leaves it and its workers die with it, and the next control plane to start removes it, but never
the directory of one that still runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator.core.private_dirs import MARKER
from orchestrator.core.processes import owner_alive, proc_start_time
from tests.conftest import REPO, TEST_OWNER

pytestmark = pytest.mark.docker  # the control plane and its worker each start a docker backend


async def _serve(data_dir: Path) -> subprocess.Popen[str]:
    """`envfleet serve` with one local worker, once it listens."""
    argv = [sys.executable, "-m", "orchestrator.cli", "serve", "--port", "0", "--data-dir", str(data_dir)]
    argv += ["--workers", "1", "--owner", TEST_OWNER, "--metrics-port", "-1"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    assert line.startswith("listening"), f"envfleet serve did not start: {line!r} (exit code {proc.poll()})"
    return proc


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of the running processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] not in (b"Z", b"X"):
            found.append((int(entry), fields[19].decode()))
    return found


async def _workers_of(pid: int, n: int) -> list[tuple[int, str]]:
    for _ in range(600):
        found = _children(pid)
        if len(found) >= n:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"control plane {pid} started no {n} worker process(es)")


async def _all_gone(processes: list[tuple[int, str]]) -> bool:
    for _ in range(300):
        if not any(owner_alive(pid, start) for pid, start in processes):
            return True
        await asyncio.sleep(0.1)
    return False


def _socket_dir_of(pid: int) -> Path:
    """The worker socket directory whose marker names process `pid`."""
    tmp = Path(tempfile.gettempdir())
    start = proc_start_time(pid)
    found = []
    for path in tmp.glob("envfleet-workers-*"):
        try:
            marker = json.loads((path / MARKER).read_text())
        except (OSError, ValueError):
            continue
        if marker.get("pid") == pid and marker.get("start") == start:
            found.append(path)
    assert len(found) == 1, f"control plane {pid} should have one worker socket directory, not {found}"
    assert (found[0] / "workers.sock").is_socket()
    return found[0]


def _stop(proc: subprocess.Popen[str], sig: int) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


async def test_a_killed_control_planes_socket_dir_goes_with_the_next_start_and_a_live_ones_stays(
    tmp_path: Path,
) -> None:
    running: list[subprocess.Popen[str]] = []
    try:
        killed = await _serve(tmp_path / "killed")
        running.append(killed)
        killed_workers = await _workers_of(killed.pid, 1)
        left = _socket_dir_of(killed.pid)
        _stop(killed, signal.SIGKILL)
        assert await _all_gone(killed_workers), "a worker outlived its control plane"
        assert left.is_dir(), "SIGKILL leaves the directory (nothing ran to remove it)"

        second = await _serve(tmp_path / "second")
        running.append(second)
        assert not os.path.lexists(left), "the next control plane should have removed the killed one's directory"
        second_dir = _socket_dir_of(second.pid)
        second_workers = await _workers_of(second.pid, 1)

        third = await _serve(tmp_path / "third")  # sweeps at start too, while the second runs
        running.append(third)
        assert (second_dir / "workers.sock").is_socket(), "a live control plane's directory was removed"
        third_dir = _socket_dir_of(third.pid)
        third_workers = await _workers_of(third.pid, 1)

        for proc in (third, second):  # a clean stop removes its own directory and stops its workers
            _stop(proc, signal.SIGTERM)
            assert proc.returncode == 0
        assert not os.path.lexists(second_dir) and not os.path.lexists(third_dir)
        assert await _all_gone(second_workers + third_workers), "a worker outlived its control plane's clean stop"
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
