"""What a sandbox's processes leave behind when they end stays charged to its memory: files in its tmpfs mounts, their
inodes, its SysV shared memory. A policy's last command that left all of it full had the grader's python3 OOM-killed
before it ran the solution (code-tests: an infrastructure failure, which masked a rollout heading for 0). Now all of it
is sized together under the memory limit with a reserve (host_config.leftovers), and the next command has room."""

from __future__ import annotations

from orchestrator.backends.docker import DockerBackend
from orchestrator.backends.docker.host_config import leftovers
from orchestrator.core.sandbox import Limits, SandboxSpec

# fills every place that outlives it, then ends: SysV segments of 1 MB until the kernel refuses one, then in /tmp,
# /dev/shm and the workspace files of 1 MB until ENOSPC, then empty files until ENOSPC (their inodes)
FILL = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
segments = 0
while segments < 100_000:
    i = libc.shmget(0, ctypes.c_size_t(1 << 20), 0o1600)
    if i < 0:
        break
    p = libc.shmat(i, None, 0)
    ctypes.memset(p, 1, 1 << 20)
    libc.shmdt(ctypes.c_void_p(p))
    segments += 1
sizes = {}
for place in ("/tmp", "/dev/shm", "/workspace"):
    written = files = 0
    try:
        while True:
            with open(f"{place}/big{written}", "wb") as f:
                f.write(b"x" * (1 << 20))
            written += 1
    except OSError:
        pass
    try:
        while True:
            open(f"{place}/empty{files}", "w").close()
            files += 1
    except OSError:
        pass
    sizes[place] = (written, files)
print(segments, sizes, flush=True)
"""


async def test_a_sandbox_full_of_what_its_commands_left_still_runs_the_next_command(
    backend: DockerBackend, base_image: str
) -> None:
    lim = Limits(memory_mb=256)
    left = leftovers(lim)
    async with await backend.create(SandboxSpec(image=base_image, limits=lim)) as s:
        r = await s.exec(["python3", "-c", FILL], timeout=300)
        assert r.exit_code == 0 and not r.oom_killed, r
        segments = int(r.stdout.split()[0])
        assert segments <= left.shm_mb, "SysV shared memory past its share"
        grader = await s.exec(["python3", "-c", "print(sum(range(10**6)))"], timeout=60)
        assert (grader.exit_code, grader.oom_killed, grader.stdout) == (0, False, b"499999500000\n"), grader
        assert (await s.state()).running
