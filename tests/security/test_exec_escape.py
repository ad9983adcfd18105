"""No process outlives its exec and no exec outlives its timeout: escapes from the process group (setsid, a double
fork, a cleared environment), fork bombs, and a full workspace that must be ENOSPC, not the sandbox's death."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import os
import signal
import tarfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from orchestrator.backends.docker import DockerBackend
from orchestrator.backends.docker.host_config import leftovers
from orchestrator.backends.envd_transport import EnvdTransport
from orchestrator.core.environment import Episode, Task
from orchestrator.core.errors import LimitNotAppliedError, SandboxDiedError, SandboxFileError, SandboxUnavailableError
from orchestrator.core.sandbox import Limits, SandboxSpec
from orchestrator.service.declarative import make_environment, parse_spec
from protos import envd_pb2 as pb
from protos import envd_pb2_grpc as pb_grpc

ESCAPE = "(env -i setsid sh -c 'sleep {n}' &)"
DOUBLE_FORK_GRADER = "(env -i setsid sh -c 'sleep 1000' &); sleep 0.5; echo '{\"reward\": 1}'"


def _pids_running(arg: str) -> list[int]:
    """Host processes whose command line is `sleep <arg>`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{name}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", arg.encode()]:
                    found.append(int(name))
    return found


@pytest.fixture
def sleeper() -> Iterator[str]:
    """A unique `sleep` argument; whatever still runs with it afterwards is killed (the test has failed by then)."""
    arg = str(900000 + (os.getpid() * 7 + int(time.time() * 1000)) % 99999)
    yield arg
    for pid in _pids_running(arg):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_an_escaped_child_dies_with_its_exec_and_does_not_hold_the_call(
    envd_client: EnvdTransport, sleeper: str
) -> None:
    t0 = time.monotonic()
    r = await envd_client.exec(f"{ESCAPE.format(n=sleeper)}; sleep 0.5; echo done", timeout=20)
    took = time.monotonic() - t0
    assert (r.exit_code, r.stdout, r.timed_out) == (0, b"done\n", False)
    assert took < 5, f"the shell exited after 0.5 s but the call took {took:.1f} s"
    assert _pids_running(sleeper) == [], "a setsid child with a cleared environment outlived its exec"


async def test_a_timeout_ends_the_call_even_when_an_escaped_child_holds_stdout(
    envd_client: EnvdTransport, sleeper: str
) -> None:
    t0 = time.monotonic()
    r = await envd_client.exec(f"{ESCAPE.format(n=sleeper)}; echo before; sleep 1000", timeout=2)
    took = time.monotonic() - t0
    assert r.timed_out and r.exit_code == 137 and r.stdout == b"before\n"
    assert took < 6, f"a 2 s timeout took {took:.1f} s"
    assert _pids_running(sleeper) == []


@pytest.fixture
async def raw_stub(
    host_envd: tuple[str, str, Path],
) -> AsyncIterator[tuple[pb_grpc.ProcessStub, tuple[tuple[str, str]]]]:
    """envd's Process stub on the host envd, with its token metadata."""
    sock, token, _ = host_envd
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        await asyncio.wait_for(ch.channel_ready(), 20)
        yield pb_grpc.ProcessStub(ch), (("authorization", f"Bearer {token}"),)


async def test_keep_background_leaves_what_it_started_running_and_returns_at_once(
    raw_stub: tuple[pb_grpc.ProcessStub, tuple[tuple[str, str]]], sleeper: str
) -> None:
    stub, md = raw_stub
    t0 = time.monotonic()
    kept = await stub.Run(
        pb.ProcessRequest(shell=f"{ESCAPE.format(n=sleeper)}; echo started", keep_background=True, timeout_s=20),
        metadata=md,
        timeout=30,
    )
    assert kept.stdout == b"started\n" and not kept.ended.timed_out
    assert time.monotonic() - t0 < 3
    assert len(_pids_running(sleeper)) == 1, "keep_background: the background process is left running"
    # a later command's end kills what that command started, not what an earlier one asked to keep
    later = await stub.Run(pb.ProcessRequest(shell="sleep 123456 & echo x"), metadata=md, timeout=30)
    assert later.stdout == b"x\n"
    assert len(_pids_running(sleeper)) == 1 and _pids_running("123456") == []


async def test_a_setsid_fork_bomb_ends_at_its_timeout(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image, limits=Limits(pids=128))) as s:
        t0 = time.monotonic()
        r = await s.exec("(env -i setsid sh -c 'b() { b | b & }; b' &); sleep 1000", timeout=5)
        took = time.monotonic() - t0
        assert r.timed_out
        assert took < 15, f"a 5 s timeout took {took:.1f} s"
        ps = await s.exec(["python3", "-c", "import os; print(sum(p.isdigit() for p in os.listdir('/proc')))"])
        assert ps.stdout == b"2\n", "envd (PID 1) and this python: the bomb is gone"


# forks sleepers until the kernel refuses one, then holds them all (a shell would exit at its first failed fork)
PID_HOG = """
import os, time
while True:
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    except OSError:
        break
time.sleep(60)
"""


async def test_envd_serves_on_while_a_command_holds_every_pid_of_the_sandbox(
    backend: DockerBackend, base_image: str
) -> None:
    # threads count against the pids limit: an envd that needs a new thread while a command holds every pid must
    # answer with what failed (the compiled envd made its threads at start: Go's runtime exits when it cannot)
    async with await backend.create(SandboxSpec(image=base_image, limits=Limits(pids=64))) as s:
        hog = asyncio.create_task(s.exec(["python3", "-c", PID_HOG], timeout=8))
        await asyncio.sleep(2)
        calls = await asyncio.gather(
            *(s.exec(["true"], timeout=5) for _ in range(8)),
            *(s.read_file("/etc/hostname") for _ in range(8)),
            *(s.list_dir("/tmp") for _ in range(8)),
            return_exceptions=True,
        )
        assert not [c for c in calls if isinstance(c, SandboxDiedError | SandboxUnavailableError)], calls
        assert (await hog).timed_out
        assert (await s.exec(["echo", "alive"])).stdout == b"alive\n"


async def test_a_declarative_scoring_command_that_double_forks_ends_on_time(
    backend: DockerBackend, base_image: str
) -> None:
    spec = parse_spec(
        {
            "name": "forker",
            "version": "1",
            "tools": ["bash", "submit"],
            "tasks": [{"id": "t1", "prompt": "p", "reference": [{"name": "submit", "arguments": {"answer": "x"}}]}],
            "scoring": {"command": DOUBLE_FORK_GRADER, "timeout_s": 5},
        }
    )
    env = make_environment(spec)
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        t0 = time.monotonic()
        score = await env.score(s, Task(id="t1", prompt="p"), Episode(turns=[], answer="x", finish="submit"))
        took = time.monotonic() - t0
        assert score.reward == 1.0
        assert took < 4, f"scoring took {took:.1f} s: the grader waited for a background child"
        ps = await s.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
        assert b"sleep 1000" not in ps.stdout


async def test_a_full_workspace_is_enospc_and_the_sandbox_lives(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image, limits=Limits(memory_mb=256))) as s:
        r = await s.exec("head -c 5G /dev/zero > /workspace/big", timeout=60)
        assert r.exit_code != 0 and not r.oom_killed
        assert b"No space left on device" in r.stderr
        r = await s.exec("head -c 5G /dev/zero > /tmp/big", timeout=60)
        assert b"No space left on device" in r.stderr
        assert (await s.exec(["echo", "alive"])).stdout == b"alive\n"
        assert (await s.state()).running


def _gzip_bomb(size: int) -> bytes:
    """A .tar.gz of one file of `size` zero bytes: a few hundred KB that expand to `size`."""
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9) as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        info = tarfile.TarInfo("bomb")
        info.size = size
        tar.addfile(info, _Zeros(size))
    return raw.getvalue()


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


async def test_a_gzip_bomb_into_the_workspace_fails_and_the_sandbox_lives(
    backend: DockerBackend, base_image: str
) -> None:
    bomb = _gzip_bomb(600 << 20)
    async with await backend.create(SandboxSpec(image=base_image, limits=Limits(memory_mb=256))) as s:
        with pytest.raises(SandboxFileError, match="No space left on device"):
            await s.upload(bomb, "/workspace")
        assert (await s.exec(["echo", "alive"])).stdout == b"alive\n"
        assert (await s.state()).running


async def test_tmpfs_caps_that_cannot_fit_under_the_memory_limit_fail_the_create(
    backend: DockerBackend, base_image: str
) -> None:
    # asked: 256 + 1024 MB of tmpfs in 1 GiB of memory; given: both scaled down under 3/4 of it, with /dev/shm, the
    # SysV shared memory and the inodes
    left = leftovers(Limits())
    assert left.charged_mb() <= 768 and left.workspace_mb > left.tmp_mb > 0
    with pytest.raises(LimitNotAppliedError, match="memory_mb=40 leaves no room"):
        await backend.create(SandboxSpec(image=base_image, limits=Limits(memory_mb=40)))
    assert await backend.list_owned() == []


async def test_a_command_that_ends_leaves_a_concurrent_commands_processes_alone(
    envd_client: EnvdTransport, sleeper: str
) -> None:
    b = asyncio.create_task(envd_client.exec(f"sleep {sleeper} & sleep 2; echo b", timeout=20))
    await asyncio.sleep(0.3)
    a = await envd_client.exec("sleep 0.2; echo a", timeout=20)
    assert a.stdout == b"a\n"
    assert len(_pids_running(sleeper)) == 1, "another command's end killed a running command's child"
    assert (await b).stdout == b"b\n"
    assert _pids_running(sleeper) == []
