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

The devpts is the container's, never this host's: it is reached through /proc/PID/root without following a link at its
end (and /dev is root's inside the container), it must be a devpts, and not the one of this process or of the host's
init (a pid that was reused by a host process would otherwise cap the host's own ptys). Its options are read back from
the entry of its own device in /proc/PID/mountinfo (as the host's user namespace sees them, which is also how fsconfig
reads them, so a remapped group stays right) and set again with the cap.
"""

from __future__ import annotations

import contextlib
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
# a reconfigure sets every devpts option at once (the others go back to the kernel's defaults): those the mount has
# (the engine's, when they cannot be read), and the cap
ENGINE_OPTIONS = {"gid": "5", "mode": "620", "ptmxmode": "666"}
KEPT_OPTIONS = ("uid", "gid", "mode", "ptmxmode")

_libc = ctypes.CDLL(None, use_errno=True)


class _Statfs(ctypes.Structure):
    _fields_ = (("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112))


def cap_ptys(pid: int, max_ptys: int) -> None:
    """Set `max=max_ptys` on the devpts of the container whose init is host process `pid` (blocking: a few system
    calls). LimitNotAppliedError says why it could not."""
    path = f"/proc/{pid}/root/dev/pts"
    try:  # the process's folder once: its root and its mount table are the same process's
        proc = os.open(f"/proc/{pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            where = os.open("root/dev/pts", os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=proc)
        finally:
            os.close(proc)
    except OSError as e:
        _check(-1, "open", path, e.errno)
    try:
        st = _Statfs()
        _check(_libc.fstatfs(where, ctypes.byref(st)), "fstatfs", path)
        if st.f_type & 0xFFFFFFFF != DEVPTS_SUPER_MAGIC:
            raise LimitNotAppliedError(f"{path} is no devpts (type {st.f_type:#x}): the ptys were not capped")
        device = os.fstat(where).st_dev
        if device in _hosts_own_devpts():
            raise LimitNotAppliedError(f"{path} is this host's own /dev/pts, so process {pid} is no sandbox's")
        options = _devpts_options(pid, device) or dict(ENGINE_OPTIONS)
        fd = _check(_libc.syscall(SYS_FSPICK, where, b"", PICK_FLAGS), "fspick", path)
    finally:
        os.close(where)
    try:
        for key, value in {**options, "max": str(max_ptys)}.items():
            _check(
                _libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_SET_STRING, key.encode(), value.encode(), 0), "fsconfig", key
            )
        _check(_libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_CMD_RECONFIGURE, None, None, 0), "fsconfig", "reconfigure")
    finally:
        os.close(fd)


def _hosts_own_devpts() -> set[int]:
    """The devices of this process's /dev/pts and of the host's init's."""
    devices = set()
    for path in ("/dev/pts", "/proc/1/root/dev/pts"):
        with contextlib.suppress(OSError):
            devices.add(os.stat(path).st_dev)
    return devices


def _devpts_options(pid: int, device: int) -> dict[str, str]:
    """The options of the devpts `device` as `pid`'s mount table shows it, those a reconfigure keeps ({} if unread)."""
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    want = f"{os.major(device)}:{os.minor(device)}"
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts, tail = fields.split(), rest.split()
        if len(parts) >= 5 and parts[2] == want and len(tail) >= 3 and tail[0] == "devpts":
            pairs = (option.partition("=") for option in tail[2].split(","))
            return {key: value for key, sep, value in pairs if sep and key in KEPT_OPTIONS}
    return {}


def _check(result: int, call: str, what: str, err: int | None = None) -> int:
    if result >= 0:
        return result
    err = err or ctypes.get_errno()
    hint = {
        errno.EPERM: ": the backend needs CAP_SYS_ADMIN and CAP_SYS_PTRACE (root on the host)",
        errno.EACCES: ": the backend needs CAP_SYS_ADMIN and CAP_SYS_PTRACE (root on the host)",
        errno.ENOSYS: ": this kernel has no fspick/fsconfig (Linux 5.2), or a seccomp filter refuses them",
    }.get(err, "")
    if hint:
        hint += "; pty_max=0 leaves each sandbox's ptys uncapped"
    raise LimitNotAppliedError(f"could not cap the sandbox's ptys ({call} {what}: {os.strerror(err)}){hint}")
