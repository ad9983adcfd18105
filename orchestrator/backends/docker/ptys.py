"""Each sandbox's share of the host's pseudo-terminals.

The kernel counts ptys for the whole host (kernel.pty.max, 4096 by default, of which kernel.pty.reserve, 1024, are
kept for the host's own /dev/pts): every container's /dev/pts draws on the other 3,072. The engine mounts each
container's devpts with no `max=`, so one sandbox that opened /dev/ptmx 3,071 times (its nofile ulimit allows 4,096)
left none to any other: pexpect, `script` and Python's pty module failed with ENOSPC in every other sandbox of the host.

So the backend sets `max=` on each sandbox's devpts once its envd runs, before any command: from this host, through
the new mount API (fspick on /proc/PID/root/dev/pts, then fsconfig), which needs no process in the container's
namespaces and runs nothing of the container's. It needs CAP_SYS_ADMIN and, to reach /proc/PID/root of a process of
another uid, CAP_SYS_PTRACE (the deploy container adds both). A pty cap that cannot be set fails the create, as any
limit does; `pty_max=0` leaves the engine's devpts as it is. Under gVisor (runsc) ptys are gVisor's own, and the cap is
not set.
"""

from __future__ import annotations

import ctypes
import errno
import os

from orchestrator.core.errors import LimitNotAppliedError

DEVPTS_SUPER_MAGIC = 0x1CD1
PTY_RESERVE = 1024  # kernel.pty.reserve: the ptys kept for the host's own /dev/pts
# the new mount API's calls have one number on every architecture
SYS_FSCONFIG, SYS_FSPICK = 431, 433
FSPICK_CLOEXEC, FSPICK_SYMLINK_NOFOLLOW, FSPICK_NO_AUTOMOUNT, FSPICK_EMPTY_PATH = 1, 2, 4, 8
PICK_FLAGS = FSPICK_CLOEXEC | FSPICK_SYMLINK_NOFOLLOW | FSPICK_NO_AUTOMOUNT | FSPICK_EMPTY_PATH
FSCONFIG_SET_STRING, FSCONFIG_CMD_RECONFIGURE = 1, 7
# a reconfigure sets every devpts option at once (the others go back to the kernel's defaults): the engine's own, and
# the cap
ENGINE_OPTIONS = (("gid", "5"), ("mode", "620"), ("ptmxmode", "666"))

_libc = ctypes.CDLL(None, use_errno=True)


class _Statfs(ctypes.Structure):
    _fields_ = (("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112))


def cap_ptys(pid: int, max_ptys: int) -> None:
    """Set `max=max_ptys` on the devpts of the container whose init is host process `pid` (blocking: a few system
    calls). LimitNotAppliedError says why it could not."""
    path = f"/proc/{pid}/root/dev/pts"
    try:
        where = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        _check(-1, "open", path, e.errno)
    try:
        st = _Statfs()
        _check(_libc.fstatfs(where, ctypes.byref(st)), "fstatfs", path)
        if st.f_type & 0xFFFFFFFF != DEVPTS_SUPER_MAGIC:
            raise LimitNotAppliedError(f"{path} is no devpts (type {st.f_type:#x}): the ptys were not capped")
        fd = _check(_libc.syscall(SYS_FSPICK, where, b"", PICK_FLAGS), "fspick", path)
    finally:
        os.close(where)
    try:
        for key, value in (*ENGINE_OPTIONS, ("max", str(max_ptys))):
            _check(
                _libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_SET_STRING, key.encode(), value.encode(), 0), "fsconfig", key
            )
        _check(_libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_CMD_RECONFIGURE, None, None, 0), "fsconfig", "reconfigure")
    finally:
        os.close(fd)


def _check(result: int, call: str, what: str, err: int | None = None) -> int:
    if result >= 0:
        return result
    err = err or ctypes.get_errno()
    hint = (
        ": the backend needs CAP_SYS_ADMIN and CAP_SYS_PTRACE (root on the host), or pty_max=0 to leave each "
        "sandbox's ptys uncapped"
        if err in (errno.EPERM, errno.EACCES)
        else ""
    )
    raise LimitNotAppliedError(f"could not cap the sandbox's ptys ({call} {what}: {os.strerror(err)}){hint}")
