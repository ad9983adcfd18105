"""Counts the kernel keeps for the whole host, not per container: one sandbox must not take them all from the others.

Asynchronous I/O: io_setup takes its events from fs.aio-max-nr (65536 by default), one count for the host. One
sandbox's io_setup(65536) took them all, and io_setup failed in every other sandbox of the host. envd's seccomp
filter now refuses io_setup and io_uring with ENOSYS (each envd in turn), so programs fall back to threads.

Pseudo-terminals: kernel.pty.max (4096, less the host's 1024) is one pool for every container's /dev/pts, which the
engine mounts with no `max=`. One sandbox that opened /dev/ptmx 3,071 times left none to any other. The backend now
sets each sandbox's devpts `max=` (pty_max) before the sandbox runs anything.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator
from typing import cast

import pytest

from orchestrator.backends.docker.backend import host_limit_warnings
from orchestrator.backends.docker.ptys import cap_ptys
from orchestrator.core.errors import LimitNotAppliedError
from orchestrator.core.sandbox import SandboxSpec
from tests.conftest import owned_backend

AIO = """
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
IO_SETUP = {"x86_64": 206, "aarch64": 0}[platform.machine()]
ctx = ctypes.c_ulong(0)
print(libc.syscall(IO_SETUP, 65536, ctypes.byref(ctx)), ctypes.get_errno())
params = ctypes.create_string_buffer(120)
print(libc.syscall(425, 8, params), ctypes.get_errno())  # io_uring_setup, the same number on every ABI
"""


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_a_sandbox_cannot_take_the_hosts_asynchronous_io(impl: str, base_image: str) -> None:
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        r = await s.exec(["python3", "-c", AIO])
        io_setup, io_uring = (line.split() for line in r.stdout.decode().splitlines())
        assert io_setup == ["-1", "38"] and io_uring == ["-1", "38"], r  # ENOSYS
        # and ordinary file I/O runs as before
        r = await s.exec(
            ["python3", "-c", "import os; open('/tmp/f', 'wb').write(b'x' * 4096); print(os.stat('/tmp/f').st_size)"]
        )
        assert r.stdout == b"4096\n", r


# opens ptys until the kernel refuses one, says how many and why, and holds them
PTY_HOG = """
import os, time
held = []
try:
    while True:
        held.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
except OSError as e:
    print(len(held), e.errno, flush=True)
time.sleep(120)
"""
ONE_PTY = "import os, pty; leader, follower = pty.openpty(); print(os.ttyname(follower).startswith('/dev/pts/'))"


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_a_sandbox_holds_at_most_its_share_of_the_hosts_ptys(impl: str, base_image: str) -> None:
    spec = SandboxSpec(image=base_image)
    async with (
        owned_backend(envd=impl) as backend,
        await backend.create(spec) as hog,
        await backend.create(spec) as other,
    ):
        cap = backend.config.pty_max
        mounts = (await hog.exec(["grep", " /dev/pts ", "/proc/mounts"])).stdout
        assert f"max={cap}".encode() in mounts and b"nosuid" in mounts and b"noexec" in mounts, mounts
        stream = cast(AsyncGenerator[object], hog.exec_stream(["python3", "-c", PTY_HOG], timeout=120))
        try:
            async for event in stream:
                if data := getattr(event, "data", b""):
                    held, err = (int(x) for x in data.split())
                    break
            else:
                pytest.fail("the hog ended without saying how many ptys it held")
            assert (held, err) == (cap, 28), "its own cap stopped it (ENOSPC)"
            r = await other.exec(["python3", "-c", ONE_PTY])
            assert r.stdout == b"True\n", r
        finally:
            await stream.aclose()


def test_the_backend_says_when_the_hosts_counts_are_short_of_its_sandboxes() -> None:
    # process ids are one pool too: at this machine's 32,768, 128 sandboxes at the default 256 processes took every
    # one, and nothing on the host could start a process
    small: dict[str, int | None] = {"kernel/pid_max": 32768, "kernel/pty/max": 4096}
    enough: dict[str, int | None] = {"kernel/pid_max": 4194304, "kernel/pty/max": 65536}
    pid_short, pty_short = host_limit_warnings(32, small.get)
    assert "kernel.pid_max is 32768: 128 sandboxes" in pid_short and "sysctl -w kernel.pid_max=4194304" in pid_short
    assert "kernel.pty.max is 4096: 96 sandboxes" in pty_short
    assert host_limit_warnings(0, small.get) == [pid_short]  # no pty cap: no share to count
    assert host_limit_warnings(32, enough.get) == []
    assert host_limit_warnings(32, lambda name: None) == []  # counts it cannot read: nothing to say


def test_the_pty_cap_never_touches_this_hosts_own_ptys() -> None:
    # the cap reaches a sandbox's devpts through /proc/PID/root of its envd: a pid that a host process took over
    # (envd gone, the number reused) would lead it to this host's own /dev/pts, whose ptys it must never cap
    with pytest.raises(LimitNotAppliedError, match="this host's own /dev/pts"):
        cap_ptys(os.getpid(), 32)
