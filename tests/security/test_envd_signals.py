"""No signal a sandbox's process can send stops envd, on real sandboxes, each envd in turn.

envd runs as the same uid as the sandbox's commands, so the kernel lets them signal it. Before, envd was docker
init's child: `kill 1` (init passes SIGTERM on) or `kill -9 <envd>` stopped it, the container went with it, and the
rollout ended INFRA_ERROR, a retry: a policy heading for a reward of 0 could trade it for another draw. Now envd is
the container's PID 1, which the kernel shields from every signal sent inside its namespace that it has no handler
for (SIGKILL and SIGSTOP always), and envd's handlers do nothing.
"""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.core.sandbox import SandboxSpec
from tests.conftest import owned_backend

# every signal a shell can name that stops, kills or pauses a process by default, or that Go or Python handle
SIGNALS = (
    *("KILL", "TERM", "INT", "HUP", "QUIT", "USR1", "USR2", "ALRM", "ABRT", "SEGV", "BUS", "FPE", "ILL", "TRAP"),
    *("SYS", "PIPE", "STOP", "TSTP", "TTIN", "TTOU", "XCPU", "XFSZ", "VTALRM", "PROF"),
)


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_no_signal_from_inside_the_sandbox_stops_envd(impl: str, base_image: str) -> None:
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        pid1 = await s.exec("tr '\\0' ' ' < /proc/1/cmdline")
        assert b"envd" in pid1.stdout, pid1.stdout  # envd is PID 1, not docker's init
        for sig in SIGNALS:
            r = await s.exec(f"kill -s {sig} 1", timeout=10)
            assert r.exit_code == 0, (sig, r.stderr)  # sent: the kernel let the sandbox's uid signal it
        # every process the sender may signal, envd's pid by name too (as it was before, under docker's init)
        r = await s.exec("kill -KILL -1; kill -KILL $PPID; kill -TERM $PPID; echo sent", timeout=10)
        assert r.stdout == b"sent\n"
        await asyncio.sleep(0.5)  # a signal acted on would have ended envd by now
        assert (await s.exec("echo alive")).stdout == b"alive\n"
        assert (await s.state()).running
        assert (await s.reset()).ok


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_commands_start_with_no_signal_ignored(impl: str, base_image: str) -> None:
    # envd takes signals with handlers that do nothing, not SIG_IGN, which a command would inherit: a test suite's
    # `timeout` or a server's SIGTERM would then be lost
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        r = await s.exec("grep SigIgn /proc/self/status")
        ignored = int(r.stdout.split()[1], 16)
        assert ignored & ((1 << 31) - 1) == 0, r.stdout  # signals 1-31 (32 comes ignored from the engine's runtime)
        r = await s.exec("sleep 30 & pid=$!; kill -TERM $pid; wait $pid; echo $?", timeout=10)
        assert r.stdout == b"143\n"
