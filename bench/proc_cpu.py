"""CPU time by kind of process on this host, read from /proc: where a benchmark's CPU went.

Each process counts its own threads (utime + stime) and, once it has reaped them, its children (cutime + cstime): an
envd's count includes the commands it ran, a shim's the runc it called. A process that exits between two readings
loses what it used since the first, so benches read around phases in which the processes they count live throughout
(the bench's own short-lived trainer process is not counted).
"""

from __future__ import annotations

import os
from collections import defaultdict

from orchestrator.core.processes import proc_stat

HZ = os.sysconf("SC_CLK_TCK")


def kind(cmdline: bytes, own_pid: int, pid: int) -> str:
    """The kind of one process, by its command line."""
    if pid == own_pid:
        return "control_plane"
    if not cmdline:
        return "kernel"  # its threads: memory reclaim (kswapd, kdamond) under pressure, block I/O, softirqs
    if b"envd/launch.py" in cmdline or b"/opt/envfleet/bin/envd" in cmdline:
        first = cmdline.split(b"\0", 1)[0]
        return "envd" if b"python" in first or first.endswith(b"/bin/envd") else "sandbox_init"
    if b"orchestrator.worker" in cmdline:
        return "workers"
    if b"scripted_policy" in cmdline:
        return "policy"
    if b"containerd-shim" in cmdline:
        return "shims"
    if b"dockerd" in cmdline or b"containerd" in cmdline:
        return "engine"
    return "other"


Reading = dict[tuple[int, int], tuple[str, float]]  # (pid, start time) -> (kind, seconds of CPU so far)


def read() -> Reading:
    """Every process's CPU so far, with its kind."""
    own = os.getpid()
    out: Reading = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = proc_stat(pid)
        if not fields:
            continue
        # this process's reaped children are the bench's short-lived helpers (its trainer process): not counted
        ticks = fields[11:13] if pid == own else fields[11:15]
        out[(pid, int(fields[19]))] = (kind(cmdline, own, pid), sum(int(x) for x in ticks) / HZ)
    return out


def per(before: Reading, after: Reading, n: float, scale: float = 1000.0) -> dict[str, float]:
    """CPU between two readings by kind, / n * scale, largest first: of the processes alive at both, what they used
    between; of those started between, all they used. What a process that exited between used is not known (see
    `exited`)."""
    delta: defaultdict[str, float] = defaultdict(float)
    for key, (k, seconds) in after.items():
        delta[k] += seconds - before.get(key, (k, 0.0))[1]
    return {k: round(v / n * scale, 2) for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v > 0}


def exited(before: Reading, after: Reading) -> dict[str, int]:
    """How many processes of each kind exited between two readings (their CPU since the first is not in `per`)."""
    gone: defaultdict[str, int] = defaultdict(int)
    for key, (k, _) in before.items():
        if key not in after:
            gone[k] += 1
    return dict(gone)
