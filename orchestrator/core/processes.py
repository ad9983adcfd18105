"""Who a process is, and whether it still runs: a pid with its kernel start time (a reused pid is someone else) and
the host and pid namespace where that pid means something. The sweeps of sandboxes and of private directories judge
an owner gone by this, and only then remove what it left."""

from __future__ import annotations

import functools
import os
import socket


def process_host() -> str:
    """Where this process's pids mean something: the host name and the pid namespace. An orchestrator in a container
    (`--network host` gives it the host's name) and one on the host then never judge each other's owners gone."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").removeprefix("pid:")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}{namespace}"


@functools.cache
def boot_id() -> str:
    """This boot of the host's kernel: CLOCK_MONOTONIC (time.monotonic) is one clock for every process of it, and a
    wall-clock jump (NTP, a VM resumed) moves it not at all. Empty where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def proc_stat(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (state first), or none for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return raw[raw.rfind(b")") + 2 :].split()


def proc_start_time(pid: int) -> str:
    """The kernel's start time of a process (clock ticks since boot), which tells a reused pid apart."""
    fields = proc_stat(pid)
    return fields[19].decode() if fields else ""


def owner_alive(pid: int, start: str) -> bool:
    """Whether process `pid` started at `start` still runs. A zombie is dead: a killed owner whose parent died too
    may wait long for a reaper (a container's init may never reap it)."""
    if pid <= 0:
        return False
    fields = proc_stat(pid)
    return bool(start) and bool(fields) and fields[19].decode() == start and fields[0] not in (b"Z", b"X")


def cpu_ticks(pid: int) -> int | None:
    """The user and system CPU a process has used (clock ticks), or None for one that cannot be making progress:
    gone, a zombie, or stopped (SIGSTOP, a debugger)."""
    fields = proc_stat(pid)
    if not fields or fields[0] in (b"Z", b"X", b"T", b"t"):
        return None
    return int(fields[11]) + int(fields[12])


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (taskset, a cpuset), and the CPU quota of its cgroup and the
    cgroups above it (a container's `--cpus`, systemd's CPUQuota=), whichever is fewer. `os.cpu_count()` counts the
    host's, and a server limited to two of 64 cores started 64 workers."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(n, quota) if quota is not None else n)


PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


def _cgroup_cpu_quota() -> int | None:
    """The tightest CPU quota over this process's cgroup and its parents, in whole CPUs rounded up (None: none).
    cgroup v2: `cpu.max` ("max 100000" or "<quota> <period>", microseconds); v1: `cpu.cfs_quota_us` (-1: none) over
    `cpu.cfs_period_us`."""
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    quotas: list[int] = []
    names: tuple[str, ...]
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            root, names = CGROUP_ROOT, ("cpu.max",)
        elif "cpu" in controllers.split(","):  # v1: mounted as listed here (cpu,cpuacct), or under cpu alone (RHEL 7)
            roots = (os.path.join(CGROUP_ROOT, controllers), os.path.join(CGROUP_ROOT, "cpu"))
            root = next((r for r in roots if os.path.isdir(r)), roots[0])
            names = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # this cgroup, then each above it (a container sees itself as /)
            folder = os.path.join(root, *parts[:depth])
            try:
                words = [w for name in names for w in _words(os.path.join(folder, name))]
                if len(words) == 2 and words[0] not in ("max", "-1") and int(words[1]) > 0:
                    quotas.append(-(-int(words[0]) // int(words[1])))
            except (OSError, ValueError):  # not there, or not what a kernel writes: no quota read from it
                continue
    return min(quotas) if quotas else None


def _words(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()
