"""envd's token stays out of the sandbox's reach: not in any environment, not in a file, not in envd's memory through
/proc or ptrace; a spec cannot choose it; and Reset leaves no IPC object for the next rollout to find."""

from __future__ import annotations

import os

import pytest

from orchestrator.backends.docker import DockerBackend
from orchestrator.backends.docker.backend import DockerSandbox
from orchestrator.backends.envd_transport import EnvdTransport
from orchestrator.core.errors import SandboxError
from orchestrator.core.sandbox import Sandbox, SandboxSpec

FIND_ENVD = "echo $PPID"  # envd is the parent of the shell it starts
PTRACE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
rc = libc.ptrace(16, int(sys.argv[1]), None, None)  # PTRACE_ATTACH
print(rc, os.strerror(ctypes.get_errno()))
"""


def _token(s: Sandbox) -> str:
    assert isinstance(s, DockerSandbox)
    transport = s.transport
    assert isinstance(transport, EnvdTransport)
    return transport._md[0][1].removeprefix("Bearer ")


async def test_the_token_is_in_no_environment_and_no_file(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        token = _token(s).encode()
        every = "for p in /proc/[0-9]*; do cat $p/environ $p/cmdline 2>/dev/null; done"
        r = await s.exec(f"cat /proc/1/environ; {every}; ls -A /run/envd")
        assert token not in r.stdout and b"ENVD_TOKEN" not in r.stdout
        assert r.stdout.rstrip().endswith(b"envd.sock"), "the token file is gone before anything runs"
        assert os.listdir(backend.config.socket_root / s.name) == ["envd.sock"]


async def test_envd_is_not_dumpable(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        pid = (await s.exec(FIND_ENVD)).stdout.split()
        assert len(pid) == 1, pid
        r = await s.exec(["sh", "-c", f"cat /proc/{pid[0].decode()}/environ; head -c 16 /proc/{pid[0].decode()}/mem"])
        assert r.exit_code != 0 and r.stdout == b""
        assert b"Permission denied" in r.stderr
        r = await s.exec(["python3", "-c", PTRACE, pid[0].decode()])
        assert r.stdout.startswith(b"-1 "), r.stdout


async def test_spec_env_cannot_choose_the_token(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image, env={"ENVD_TOKEN": "forged"})) as s:
        assert _token(s) != "forged"
        assert b"ENVD_TOKEN" not in (await s.exec("env")).stdout
        forged = EnvdTransport(str(backend.config.socket_root / s.name / "envd.sock"), "forged")
        try:
            with pytest.raises(SandboxError, match="token"):
                await forged.exec(["true"])
        finally:
            await forged.close()


IPC = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(0, 4096, 0o1600) >= 0  # IPC_PRIVATE, IPC_CREAT | 0600
assert libc.msgget(0, 0o1600) >= 0
assert libc.semget(0, 1, 0o1600) >= 0
open("/dev/mqueue/leak", "w").close()  # a file created in the mqueue fs is a POSIX message queue
"""


async def test_reset_removes_sysv_ipc_and_message_queues(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        r = await s.exec(["python3", "-c", IPC])
        assert r.exit_code == 0, r.stderr
        listing = "tail -qn +2 /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem; ls -A /dev/mqueue"
        assert len((await s.exec(listing)).stdout.splitlines()) == 4
        outcome = await s.reset()
        assert outcome.ok, outcome.detail
        assert (await s.exec(listing)).stdout == b""
