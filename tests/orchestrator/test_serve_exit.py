"""`envfleet serve` ends when it is told to: a thread still at work (an image build) does not hold its exit, and a
second signal ends a stop that hangs (a wedged engine)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TEST_OWNER

# serve on the fake backend, with one change made before it starts
WRAPPER = """
import asyncio, sys, time
from orchestrator.cli import main as cli
from orchestrator.server import app
{patch}
sys.argv = ["envfleet", *sys.argv[1:]]
cli.main()
"""
# an image build in the default executor's thread, as the image resolver runs one, that outlives the stop
BUILDING = """
create = app.create_server
async def create_server(*a, **k):
    asyncio.get_running_loop().run_in_executor(None, time.sleep, 600)
    return await create(*a, **k)
app.create_server = create_server
"""
# a stop that never ends (each removal waits on an engine that does not answer)
WEDGED = """
async def stop(self, grace=None):
    print("stopping", flush=True)
    await asyncio.sleep(600)
app.Orchestrator.stop = stop
"""


def _serve(tmp_path: Path, patch: str) -> subprocess.Popen[str]:
    args = ["serve", "--port", "0", "--metrics-port", "-1", "--workers", "0", "--backend", "fake"]
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER.format(patch=patch), *args, "--data-dir", str(tmp_path), "--owner", TEST_OWNER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("listening"), (line, proc.stderr.read() if proc.stderr else "")
    return proc


def _waited(proc: subprocess.Popen[str], within_s: float) -> int | None:
    try:
        return proc.wait(within_s)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize("wedged", [False, True])
def test_serve_exits_on_its_signal(tmp_path: Path, wedged: bool) -> None:
    proc = _serve(tmp_path, WEDGED if wedged else BUILDING)
    try:
        proc.send_signal(signal.SIGTERM)
        if wedged:  # the first signal's stop hangs; the second ends the process
            assert proc.stdout is not None and proc.stdout.readline().strip() == "stopping"
            time.sleep(0.5)
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
        code = _waited(proc, 30)
        if code is None:  # still running: ended here, before its output is read to the end
            proc.kill()
            proc.wait()
        assert code == (128 + signal.SIGTERM if wedged else 0), proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
