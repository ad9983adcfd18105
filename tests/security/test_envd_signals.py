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


# each call that sends a signal with an si_code of the sender's choosing (not SI_USER, as kill's): Go's runtime took
# such a SIGSEGV (BUS, FPE, ILL, TRAP, STKFLT, SYS) for a fault of its own and died. x86_64 numbers; rt_sigqueueinfo
# and pidfd_send_signal with si_code SI_QUEUE; tkill and the queued calls to an envd thread that is not its leader;
# and a pipe's I/O signal set to one (fcntl F_SETSIG) with envd as its owner
FAULTS = """
import ctypes, fcntl, os, signal
libc = ctypes.CDLL(None, use_errno=True)
SIGNALS = [signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP, 16, signal.SIGSYS]
threads = sorted(int(t) for t in os.listdir("/proc/1/task"))
info = (ctypes.c_int * 32)()
pidfd = libc.syscall(434, 1, 0)  # pidfd_open
sent = refused = 0
for sig in SIGNALS:
    info[0], info[1], info[2] = sig, 0, -1  # si_signo, si_errno, si_code = SI_QUEUE
    for tid in threads:
        calls = [(234, 1, tid, sig), (200, tid, sig), (129, tid, sig, info), (297, 1, tid, sig, info)]
        calls.append((424, pidfd, sig, info, 0))
        for call in calls:
            if libc.syscall(*call) == 0:
                sent += 1
            else:
                refused += ctypes.get_errno() == 1
    # a file's I/O signal, chosen with F_SETSIG, goes to its owner: envd (F_SETOWN 1), with si_code POLL_IN
    r, w = os.pipe()
    fcntl.fcntl(r, fcntl.F_SETOWN, 1)
    try:
        fcntl.fcntl(r, 10, sig)  # F_SETSIG
        fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)
        os.write(w, b"x")
        sent += 1
    except PermissionError:
        refused += 1
    os.close(r)
    os.close(w)
print(sent, refused, len(SIGNALS) * (len(threads) * 5 + 1))
"""


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_no_fault_signal_sent_with_a_chosen_code_stops_envd(impl: str, base_image: str) -> None:
    async with owned_backend(envd=impl) as backend, await backend.create(SandboxSpec(image=base_image)) as s:
        await s.write_file("/tmp/faults.py", FAULTS.encode())
        r = await s.exec(["python3", "/tmp/faults.py"], timeout=30)
        assert r.exit_code == 0, r.stderr
        sent, refused, tried = map(int, r.stdout.split())
        if impl == "go":  # the Go envd's filter refuses them (EPERM); the Python one's handlers take them
            assert (sent, refused) == (0, tried), r.stdout
        await asyncio.sleep(0.5)  # a signal acted on would have ended envd by now
        assert (await s.exec("echo alive")).stdout == b"alive\n"
        assert (await s.state()).running
        # a process may still fault itself: raise() is tgkill to its own thread group
        r = await s.exec(["python3", "-c", "import signal; signal.raise_signal(signal.SIGSEGV)"], timeout=30)
        assert r.signal == 11 or r.exit_code == -11 or r.exit_code == 139, r
