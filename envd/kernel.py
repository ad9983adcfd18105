"""What envd asks of the kernel through libc: prctl (sub-reaper, non-dumpable), a seccomp filter and SysV IPC removal.

ctypes is loaded once, at start; these calls have no wrapper in the os module.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
IPC_RMID = 0
# /proc/sysvipc/<kind> lists the objects of the sandbox's IPC namespace; the second column is the id
SYSV_KINDS = ("shm", "sem", "msg")

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def become_subreaper() -> bool:
    """Orphans of envd's commands are re-parented to envd, not to init: an escaped process stays findable.

    False where the kernel has no sub-reapers (gVisor's runsc answers EINVAL): orphans then go to init (PID 1), and
    envd looks for what its commands left under init as well (envd/reaper.py).
    """
    try:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return True


def make_non_dumpable() -> None:
    """No process of the sandbox (same uid) may ptrace envd or read its memory or environ through /proc."""
    _prctl(PR_SET_DUMPABLE, 0)


# Every process of a sandbox runs as envd's own uid, and the kernel lets a process set the resource limits of any
# other process of its uid (prlimit): a command could lower envd's (a CPU time of one second: the kernel kills it,
# the sandbox dies, and a rollout heading for 0 becomes an infrastructure retry) or a concurrent command's (the
# grader's), and every command envd starts later inherits envd's. A seccomp filter installed on envd at start,
# inherited by everything it runs, refuses to set another process's limits (envd/go/limits.go is the same filter).
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
# BPF: load a word at an offset of struct seccomp_data; jump on equal; return
LD_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06
OFF_NR, OFF_ARCH, OFF_ARG0, OFF_ARG2, OFF_ARG2_HIGH = 0, 4, 16, 32, 36
# prlimit64 on each ABI a process of this host may call it through: (audit arch, number, whether the kernel reads
# its pointer as 64 bits)
PRLIMIT_ABIS = (
    (0xC000003E, 302, True),  # x86_64
    (0xC000003E, 0x40000000 | 302, True),  # x32: the common entry, which reads the whole 64-bit register
    (0x40000003, 340, False),  # i386
    (0xC00000B7, 261, True),  # aarch64
    (0x40000028, 369, False),  # arm
)
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
# The kernel's asynchronous I/O, refused with ENOSYS (programs that use it fall back to threads: libaio's, libuv):
# io_setup takes its events from one count for the whole host (fs.aio-max-nr, 65536 by default), so one sandbox that
# took them all failed io_setup in every other sandbox of the host; io_uring is a large part of the kernel to expose
# to hostile code for no gain here. Each ABI's numbers (x32's io_setup has one of its own); envd/go/limits.go too.
_X32 = 0x40000000
REFUSED_CALLS = (
    (0xC000003E, (206, 425, 426, 427, _X32 | 543, _X32 | 425, _X32 | 426, _X32 | 427)),  # x86_64 and x32
    (0x40000003, (245, 425, 426, 427)),  # i386
    (0xC00000B7, (0, 425, 426, 427)),  # aarch64
    (0x40000028, (243, 425, 426, 427)),  # arm
)


def prlimit_filter() -> list[tuple[int, int, int, int]]:
    """The filter: (code, jump if true, jump if false, k) each. prlimit64 with a pid other than 0 (the caller) and
    new limits to set is refused (EPERM); reading another's limits, and every other call, is allowed."""
    code: list[tuple[int, int, int, int]] = []
    labels: dict[str, int] = {}
    jumps: dict[int, tuple[str, str]] = {}

    def jeq(k: int, yes: str, no: str) -> None:
        jumps[len(code)] = (yes, no)
        code.append((JEQ_K, 0, 0, k))

    code.append((LD_ABS, 0, 0, OFF_ARCH))
    for i, (arch, nr, wide) in enumerate(PRLIMIT_ABIS):
        jeq(arch, "", f"abi{i}")
        code.append((LD_ABS, 0, 0, OFF_NR))
        jeq(nr, "wide" if wide else "narrow", f"abi{i}")
        labels[f"abi{i}"] = len(code)
        if i < len(PRLIMIT_ABIS) - 1:
            code.append((LD_ABS, 0, 0, OFF_ARCH))
    code.append((RET_K, 0, 0, SECCOMP_RET_ALLOW))
    for width in ("wide", "narrow"):
        labels[width] = len(code)
        code.append((LD_ABS, 0, 0, OFF_ARG0))  # pid_t: the kernel reads the low 32 bits
        jeq(0, "allow", "")
        code.append((LD_ABS, 0, 0, OFF_ARG2))
        if width == "wide":
            jeq(0, "", "deny")
            code.append((LD_ABS, 0, 0, OFF_ARG2_HIGH))
        jeq(0, "allow", "deny")
    labels["allow"] = len(code)
    code.append((RET_K, 0, 0, SECCOMP_RET_ALLOW))
    labels["deny"] = len(code)
    code.append((RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM))
    for at, (yes, no) in jumps.items():
        c, _, _, k = code[at]
        code[at] = (c, labels[yes] - at - 1 if yes else 0, labels[no] - at - 1 if no else 0, k)
    return code


def refused_filter() -> list[tuple[int, int, int, int]]:
    """The filter: ENOSYS for REFUSED_CALLS, every other call allowed."""
    code: list[tuple[int, int, int, int]] = [(LD_ABS, 0, 0, OFF_ARCH)]
    refusals: list[int] = []  # the jumps to the refusal, resolved once its place is known
    for arch, numbers in REFUSED_CALLS:
        # not this arch: past this arch's numbers and its return (the accumulator still holds the arch)
        code.append((JEQ_K, 0, len(numbers) + 2, arch))
        code.append((LD_ABS, 0, 0, OFF_NR))
        for nr in numbers:
            refusals.append(len(code))
            code.append((JEQ_K, 0, 0, nr))
        code.append((RET_K, 0, 0, SECCOMP_RET_ALLOW))
    code.append((RET_K, 0, 0, SECCOMP_RET_ALLOW))
    refuse = len(code)
    code.append((RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS))
    for at in refusals:
        c, _, jf, k = code[at]
        code[at] = (c, refuse - at - 1, jf, k)
    return code


class _SockFilter(ctypes.Structure):
    _fields_ = (("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32))


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter)))


def guard_limits() -> None:
    """Install prlimit_filter and refused_filter on every thread of envd, and so on every process it starts from now
    on."""
    nr = SYS_SECCOMP.get(os.uname().machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"seccomp: no syscall number known for {os.uname().machine}")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # a filter needs it (the container has it already)
    for program in (prlimit_filter(), refused_filter()):
        filters = (_SockFilter * len(program))(*(_SockFilter(*insn) for insn in program))
        prog = _SockFprog(len(program), filters)
        if _libc.syscall(nr, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(prog)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"seccomp: {os.strerror(err) if err else 'a thread could not take the filter'}")


# Signals whose default ends or stops a process and that only another process sends (kill), never a fault of envd's
# own: SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP and SIGSYS keep their default, so a real crash is a crash.
_TAKEN = (
    *("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF"),
    *("SIGXCPU", "SIGXFSZ", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGPWR", "SIGSTKFLT", "SIGIO"),
)


def ignore_signals() -> None:
    """envd as the sandbox's PID 1: every signal a sandbox process can send it reaches nothing.

    The kernel delivers no signal to a PID namespace's init from inside the namespace unless init has a handler for
    it (SIGKILL and SIGSTOP never), and Python has one for SIGINT (KeyboardInterrupt: envd exits). Each signal that
    would end or stop envd gets a handler that does nothing, so envd stays up where a runtime does not shield its
    init as Linux does. Handlers, not SIG_IGN, which commands would inherit. The host removes the container with a
    SIGKILL, which comes from outside the namespace.
    """
    taken = [getattr(signal, name) for name in _TAKEN if hasattr(signal, name)]
    taken += range(signal.SIGRTMIN, signal.SIGRTMAX + 1)
    for signum in taken:
        signal.signal(signum, _ignore)


def _ignore(signum: int, frame: object) -> None:
    """A signal handler that does nothing."""


def sysv_ids(kind: str) -> list[int]:
    """The ids of the SysV IPC objects of one kind ("shm", "sem", "msg") in this IPC namespace."""
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            lines = f.read().splitlines()[1:]
    except FileNotFoundError:
        return []
    return [int(line.split()[1]) for line in lines if line.strip()]


def remove_sysv(kind: str, ident: int) -> None:
    """Remove one SysV IPC object (IPC_RMID); a shared memory segment goes once its last user detaches."""
    if kind == "shm":
        rc = _libc.shmctl(ident, IPC_RMID, None)
    elif kind == "sem":
        rc = _libc.semctl(ident, 0, IPC_RMID)
    else:
        rc = _libc.msgctl(ident, IPC_RMID, None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"removing SysV {kind} {ident}: {os.strerror(err)}")
