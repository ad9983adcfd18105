"""No process of a sandbox sets envd's resource limits, or another process's, on real sandboxes, each envd in turn.

Every process of a sandbox runs as envd's uid, and the kernel lets a process set the limits of any process of its uid
(prlimit). A command lowered envd's: a CPU time of one second, and the kernel killed envd, the sandbox died, and a
rollout heading for a reward of 0 became an infrastructure retry; or a CPU time of a few seconds, and every later
command, the grader's too and those of the next rollout on a recycled sandbox (Reset did not look), inherited it. A
concurrent command's (the grader's) could be set the same way. envd now installs a seccomp filter that everything it
runs inherits: a process's own limits stay its own to set.
"""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.core.sandbox import SandboxSpec
from tests.conftest import owned_backend

PROBE = r"""
import resource as r, sys
for pid in (1, int(sys.argv[1])):  # envd, and a concurrent command
    for limit in (r.RLIMIT_CPU, r.RLIMIT_NOFILE, r.RLIMIT_AS):
        try:
            r.prlimit(pid, limit, (1, 1))
            print(pid, limit, "set")
        except PermissionError:
            print(pid, limit, "refused")
print("read", r.prlimit(1, r.RLIMIT_NOFILE)[0] > 0)  # reading another's stays allowed
r.setrlimit(r.RLIMIT_CPU, (100, r.RLIM_INFINITY))
r.prlimit(0, r.RLIMIT_FSIZE, (1 << 20, r.RLIM_INFINITY))
print("own", r.getrlimit(r.RLIMIT_CPU)[0], r.getrlimit(r.RLIMIT_FSIZE)[0])
"""


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_no_process_of_the_sandbox_sets_envds_or_another_commands_limits(impl: str, base_image: str) -> None:
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        before = (await s.exec("cat /proc/1/limits")).stdout
        await s.write_file("/tmp/probe.py", PROBE.encode())
        r = await s.exec("sleep 30 & python3 /tmp/probe.py $!; kill $!", timeout=30)
        lines = r.stdout.decode().splitlines()
        assert all(line.endswith("refused") for line in lines[:6]), (lines, r.stderr)
        assert lines[6:] == ["read True", f"own 100 {1 << 20}"], (lines, r.stderr)
        await asyncio.sleep(1.5)  # past a CPU time of one second, had envd's been set
        assert (await s.exec("cat /proc/1/limits")).stdout == before
        assert (await s.exec("ulimit -t; ulimit -n")).stdout.split() == [b"unlimited", str(4096).encode()]
        assert (await s.reset()).ok
