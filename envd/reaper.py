"""Finding and killing what envd's commands left behind.

envd is its processes' sub-reaper (envd/kernel.py): a process that escapes its command's process group by setsid,
a double fork or a cleared environment is re-parented to envd, never to init, so "everything envd started" is the
subtree under envd in /proc. Killing it stops the subtree first (SIGSTOP, repeated until no new process shows up),
so a fork bomb cannot outrun the kill, then SIGKILLs it and reaps what envd itself inherited.

Where the kernel has no sub-reapers (gVisor), orphans go to init: the "adopters" are then envd and PID 1, and
what is under either (envd itself apart) counts as started by envd, since nothing else runs in a sandbox.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass

STOP_ROUNDS = 200
KILL_ROUNDS = 100


@dataclass(frozen=True)
class Proc:
    """One line of the process table."""

    ppid: int
    pgid: int
    state: str
    start: int  # clock ticks after boot: with the pid, names a process across pid reuse
    threads: int

    @property
    def dead(self) -> bool:
        """A zombie, which only waits for its parent to reap it. Not one whose main thread exited while its other
        threads run: /proc shows it Z as well (with its thread count), and it was left alive by every kill and Reset."""
        return self.state == "Z" and self.threads <= 1


def proc_table() -> dict[int, Proc]:
    """pid -> Proc for every visible process."""
    table: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        table[int(name)] = Proc(int(fields[1]), int(fields[2]), fields[0].decode(), int(fields[19]), int(fields[17]))
    return table


def subtree(table: dict[int, Proc], root: int, skip: Collection[int] = ()) -> set[int]:
    """The live (not dead) descendants of `root`, not entering the subtrees rooted at `skip`."""
    children: dict[int, list[int]] = {}
    for p, info in table.items():
        children.setdefault(info.ppid, []).append(p)
    found: set[int] = set()
    stack = [root]
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in found and c not in skip:
                found.add(c)
                stack.append(c)
    return {p for p in found if not table[p].dead}


def under(table: dict[int, Proc], adopters: Collection[int], skip: Collection[int] = ()) -> set[int]:
    """The live descendants of every adopter (envd, and init where orphans go there), envd itself and the subtrees
    rooted at `skip` apart."""
    me = os.getpid()
    found: set[int] = set()
    for root in adopters:
        found |= subtree(table, root, skip if root == me else {*skip, me})
    return found


def reap_adopted(managed: Collection[int], table: dict[int, Proc] | None = None) -> None:
    """Reap envd's zombie children that asyncio does not wait for (orphans envd adopted as sub-reaper)."""
    me = os.getpid()
    for pid, info in (proc_table() if table is None else table).items():
        if info.ppid == me and info.dead and pid not in managed:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _signal_all(pids: Collection[int], signum: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signum)


def kill_subtree(skip: Collection[int], managed: Collection[int], adopters: Collection[int] = ()) -> list[int]:
    """Kill every process under envd (and the other `adopters`) except the subtrees rooted at `skip`; returns the
    survivors (none, normally).

    `managed` are the children asyncio waits for: they are killed like the rest but reaped by asyncio.
    """
    roots = adopters or (os.getpid(),)
    table = proc_table()
    stopped: set[int] = set()
    for _ in range(STOP_ROUNDS):  # stop first: a stopped process forks no more
        doomed = under(table, roots, skip) - stopped
        if not doomed:
            break
        _signal_all(doomed, signal.SIGSTOP)
        stopped |= doomed
        table = proc_table()
    if not stopped:  # the common case: nothing was left behind; one scan of /proc in all
        reap_adopted(managed, table)
        return []
    left: set[int] = set()
    for _ in range(KILL_ROUNDS):
        left = under(proc_table(), roots, skip)
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        reap_adopted(managed)
        time.sleep(0.001)
    reap_adopted(managed)
    return sorted(under(proc_table(), roots, skip))
