"""Counts the kernel keeps for the whole host, not per container: one sandbox must not take them all from the others.

Asynchronous I/O: io_setup takes its events from fs.aio-max-nr (65536 by default), one count for the host. One
sandbox's io_setup(65536) took them all, and io_setup failed in every other sandbox of the host. envd's seccomp
filter now refuses io_setup and io_uring with ENOSYS (each envd in turn), so programs fall back to threads.
"""

from __future__ import annotations

import pytest

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
