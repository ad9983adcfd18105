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


def _serve(tmp_path: Path, patch: str) -> tuple[subprocess.Popen[str], str]:
    """The server and the address it listens on."""
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
    return proc, line.split()[1]


def _waited(proc: subprocess.Popen[str], within_s: float) -> int | None:
    try:
        return proc.wait(within_s)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize("wedged", [False, True])
def test_serve_exits_on_its_signal(tmp_path: Path, wedged: bool) -> None:
    proc, _ = _serve(tmp_path, WEDGED if wedged else BUILDING)
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


def _serve_fails(*args: str) -> str:
    """The last line a serve that ends in an error says (metrics off unless `args` name a port for them)."""
    metrics = [] if "--metrics-port" in args else ["--metrics-port", "-1"]
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--backend", "fake", *metrics, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


def test_serve_refuses_a_port_in_use_and_a_data_dir_it_cannot_use_in_one_line(tmp_path: Path) -> None:
    # a port in use was a RuntimeError's traceback, or, gRPC binding with SO_REUSEPORT, no error at all: the second
    # server shared the port, and the kernel spread a trainer's connections over both control planes
    first, address = _serve(tmp_path / "first", "")
    try:
        port = address.rpartition(":")[2]
        said = _serve_fails("--port", port, "--workers", "0", "--data-dir", str(tmp_path / "second"))
        assert f"cannot listen on 127.0.0.1:{port} (--host, --port): the port is taken" in said, said
    finally:
        first.terminate()
        assert first.wait(30) == 0
        for pipe in (first.stdout, first.stderr):
            if pipe is not None:
                pipe.close()
    (tmp_path / "file").write_text("")
    said = _serve_fails("--port", "0", "--data-dir", str(tmp_path / "file"))
    assert said == f"envfleet serve: the data directory {tmp_path / 'file'} (--data-dir) is not a directory"
    said = _serve_fails("--port", "0", "--workers", "1", "--worker-token-file", str(tmp_path / "none"))
    assert said == f"envfleet serve: No such file or directory: {tmp_path / 'none'}"


def test_serve_starts_a_worker_per_cpu_it_may_use(tmp_path: Path) -> None:
    # os.cpu_count() counts the host's: under `taskset -c 0` (or a container's cpuset) a server started a worker
    # for every core of the host
    script = (
        "from orchestrator.cli.main import _server_config, build_parser; "
        f"print(_server_config(build_parser().parse_args(['serve', '--data-dir', {str(tmp_path)!r}])).workers)"
    )
    done = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr


def test_a_metrics_or_viewer_port_the_operator_named_that_is_taken_is_an_error(tmp_path: Path) -> None:
    # it was replaced by a free port with a warning: Prometheus, scraping the port it was told, read another server
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        common = ["--port", "0", "--workers", "0", "--data-dir", str(tmp_path)]
        said = _serve_fails(*common, "--metrics-port", str(port))
        assert (
            said == f"envfleet serve: cannot serve metrics on 127.0.0.1:{port} (--metrics-port): Address already in use"
        )
        said = _serve_fails(*common, "--ui-port", str(port))
        assert (
            said == f"envfleet serve: cannot serve the viewer on 127.0.0.1:{port} (--ui-port): Address already in use"
        )


@pytest.mark.parametrize(
    ("cgroup", "files", "cpus"),
    [
        # v2, a quota of 1.5 CPUs on a parent of this process's cgroup (systemd's CPUQuota=): 2
        ("0::/system.slice/envfleet.service\n", {"system.slice/cpu.max": "150000 100000"}, 2),
        ("0::/a/b\n", {"a/b/cpu.max": "max 100000", "cpu.max": "max 100000"}, None),
        # v1, 0.5 of a CPU: 1
        (
            "4:cpu,cpuacct:/docker/x\n",
            {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "50000", "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000"},
            1,
        ),
        ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, None),
        # RHEL 7 lists cpuacct,cpu and mounts it under cpu: 3 CPUs
        ("4:cpuacct,cpu:/x\n", {"cpu/x/cpu.cfs_quota_us": "250000", "cpu/x/cpu.cfs_period_us": "100000"}, 3),
        ("0::/\n", {"cpu.max": ""}, None),  # nothing a kernel writes: no quota, no crash
    ],
)
def test_the_cgroup_cpu_quota_is_read_where_the_process_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cgroup: str, files: dict[str, str], cpus: int | None
) -> None:
    # only the root's cpu.max was read: a quota on the process's own cgroup or a parent (systemd), or cgroup v1's,
    # was not seen, and a server limited to half a CPU started a worker per core
    from orchestrator.core import processes

    (tmp_path / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / "fs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / name).write_text(text + "\n")
    monkeypatch.setattr(processes, "PROC_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(processes, "CGROUP_ROOT", str(tmp_path / "fs"))
    assert processes._cgroup_cpu_quota() == cpus
