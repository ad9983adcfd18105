"""Reset a sandbox in place between rollouts: kill every process but envd and init, wipe every writable place (SysV
IPC objects and POSIX message queues too), restore the workspace from its seed, then verify. Anything left means
the sandbox is not reused."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from envd.kernel import SYSV_KINDS, remove_sysv, sysv_ids
from envd.reaper import Proc, proc_table, reap_adopted

KILL_ROUNDS = 50
MQUEUE_DIR = "/dev/mqueue"


@dataclass(frozen=True)
class ResetResult:
    """Whether the sandbox is pristine again, and what was not."""

    ok: bool
    detail: str
    killed: int
    duration_s: float


def _other_pids(table: dict[int, Proc] | None = None) -> list[int]:
    """Live processes but init and envd (a zombie is dead: it only waits for its parent to reap it)."""
    me = os.getpid()
    return [p for p, info in (proc_table() if table is None else table).items() if p not in (1, me) and not info.dead]


def kill_all_others(managed: Collection[int] = ()) -> tuple[int, list[int]]:
    """SIGKILL every process except PID 1 (init) and envd itself until none is left; returns (killed, survivors).

    envd reaps the orphans it adopted as sub-reaper; `managed` (children asyncio waits for) it leaves to asyncio.
    """
    killed = 0
    for _ in range(KILL_ROUNDS):
        table = proc_table()
        pids = _other_pids(table)
        if not pids:
            reap_adopted(managed, table)  # the same scan: one in all when nothing is left (the common case)
            return killed, []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.01)
        reap_adopted(managed)
    return killed, _other_pids()


def clear_ipc() -> list[str]:
    """Remove every SysV IPC object and POSIX message queue; returns what could not be removed."""
    failed = []
    for kind in SYSV_KINDS:
        for ident in sysv_ids(kind):
            try:
                remove_sysv(kind, ident)
            except OSError as e:
                failed.append(str(e))
    failed += _empty_dir(MQUEUE_DIR)
    return failed


def _ipc_left() -> list[str]:
    left = [f"SysV {kind} {ident}" for kind in SYSV_KINDS for ident in sysv_ids(kind)]
    with contextlib.suppress(FileNotFoundError):
        left += [f"message queue {name}" for name in os.listdir(MQUEUE_DIR)]
    return left


def _empty_dir(path: str, keep: Iterable[str] = ()) -> list[str]:
    """Remove everything inside `path` (links removed, never followed); returns what could not be removed."""
    failed = []
    keep_set = set(keep)
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    for name in names:
        if name in keep_set:
            continue
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(full)
            else:
                os.unlink(full)
        except OSError as e:
            failed.append(f"{full}: {e.strerror}")
    return failed


def _restore_inodes(modes: Mapping[str, int]) -> list[str]:
    """Put the wiped places' own inodes (and envd's socket) back as envd found them at its start: their permission
    bits, no user xattrs, and the reset's time as theirs. Emptied, a place still carried what a rollout set on the
    place itself (a chmod, `touch -d`, a `user.` xattr: 60-odd bits a rollout can read in the next). envd runs as the
    sandbox's user, so what a rollout could change, envd can put back; what envd may not touch, neither could it."""
    problems = []
    for path, mode in modes.items():
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            problems.append(f"{path} was replaced by a link")
            continue
        with contextlib.suppress(PermissionError):
            if stat.S_IMODE(st.st_mode) != mode:
                os.chmod(path, mode)
            os.utime(path)
        with contextlib.suppress(OSError):  # ENOTSUP: a filesystem without xattrs has none to clear
            for name in os.listxattr(path, follow_symlinks=False):
                if name.startswith("user."):
                    with contextlib.suppress(PermissionError):
                        os.removexattr(path, name, follow_symlinks=False)
        if stat.S_IMODE(os.lstat(path).st_mode) != mode:
            problems.append(f"{path}: mode {stat.S_IMODE(os.lstat(path).st_mode):o}, not {mode:o}")
        with contextlib.suppress(OSError):
            if any(n.startswith("user.") for n in os.listxattr(path, follow_symlinks=False)):
                problems.append(f"{path} keeps user xattrs")
    return problems


def _copy_seed(seed: str, workspace: str) -> None:
    for name in os.listdir(seed):
        src, dst = os.path.join(seed, name), os.path.join(workspace, name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)


def reset_sandbox(
    workspace: str,
    socket_dir: str,
    socket_name: str,
    seed: str,
    managed: Collection[int] = (),
    modes: Mapping[str, int] | None = None,
) -> ResetResult:
    """Kill, wipe, restore, verify. `managed`: envd's children that asyncio reaps; `modes`: the permission bits of
    the places and the socket when envd started, put back with their times and xattrs.

    Refused when envd runs as root: a sandbox's envd never does (it runs as the sandbox's user), and an envd
    started as root on a host would empty the host's /tmp and /dev/shm and kill what it can see."""
    t0 = time.monotonic()
    if os.geteuid() == 0:
        return ResetResult(False, "envd runs as root, so this is no sandbox: reset refused", 0, 0.0)
    problems: list[str] = []
    killed, survivors = kill_all_others(managed)
    if survivors:
        problems.append(f"processes survived SIGKILL: {survivors}")
    places = {"/tmp": (), "/dev/shm": (), workspace: (), socket_dir: (socket_name,)}
    problems += _restore_inodes(modes or {})  # first: a place a rollout made unreadable is readable again
    for place, keep in places.items():
        problems += _empty_dir(place, keep)
    problems += clear_ipc()
    if seed:
        try:
            _copy_seed(seed, workspace)
        except OSError as e:
            problems.append(f"restoring the workspace from {seed}: {e}")
    # verify: nothing but the allowed entries is left anywhere writable
    for place, keep in places.items():
        with contextlib.suppress(FileNotFoundError):
            left = set(os.listdir(place)) - set(keep)
            if place == workspace and seed:
                left -= set(os.listdir(seed))
            if left:
                problems.append(f"{place} still holds {sorted(left)[:5]}")
    ipc = _ipc_left()
    if ipc:
        problems.append(f"IPC objects survived: {ipc[:5]}")
    appeared = _other_pids()
    if appeared:
        problems.append(f"processes appeared during the reset: {appeared}")
    return ResetResult(not problems, summary(problems), killed, time.monotonic() - t0)


# what a reset tells of what it could not clean: a line a problem, the first MAX_PROBLEMS of them (envd/go/reset.go
# too). Each folder left in /tmp was a line: a rollout that left 240,000 it could not remove made every reset of its
# sandbox answer 64 MiB, which the worker read and logged
MAX_PROBLEMS = 10


def summary(problems: list[str]) -> str:
    """The problems as the reset's detail: the first MAX_PROBLEMS, and how many more."""
    more = len(problems) - MAX_PROBLEMS
    return "; ".join(problems[:MAX_PROBLEMS] + ([f"and {more} more"] if more > 0 else []))
