"""What envd asks of the kernel through libc: prctl (sub-reaper, non-dumpable) and SysV IPC removal.

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
