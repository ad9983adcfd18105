"""CPU time by kind of process on this host, read from /proc: where a benchmark's CPU went.

Each process counts its own threads (utime + stime) and, once it has reaped them, its children (cutime + cstime): an
envd's count includes the commands it ran, a shim's the runc it called. A process that exits between two readings
loses what it used since the first, so benches read around phases in which the processes they count live throughout
(the bench's own short-lived trainer process is not counted).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping

HZ = os.sysconf("SC_CLK_TCK")


def kind(cmdline: bytes, own_pid: int, pid: int) -> str:
    """The kind of one process, by its command line."""
    if pid == own_pid:
        return "control_plane"
    if b"envd/launch.py" in cmdline:
        return "envd" if b"python" in cmdline.split(b"\0", 1)[0] else "sandbox_init"
    if b"orchestrator.worker" in cmdline:
        return "workers"
    if b"scripted_policy" in cmdline:
        return "policy"
    if b"containerd-shim" in cmdline:
        return "shims"
    if b"dockerd" in cmdline or b"containerd" in cmdline:
        return "engine"
    return "other"


def cpu_by_kind() -> dict[str, float]:
    """Seconds of CPU so far, summed by kind of process."""
    own = os.getpid()
    total: defaultdict[str, float] = defaultdict(float)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        pid = int(entry.name)
        # this process's reaped children are the bench's short-lived helpers (its trainer process): not counted
        ticks = fields[11:13] if pid == own else fields[11:15]
        total[kind(cmdline, own, pid)] += sum(int(x) for x in ticks) / HZ
    return dict(total)


def per(before: Mapping[str, float], after: Mapping[str, float], n: float, scale: float = 1000.0) -> dict[str, float]:
    """(after - before) / n * scale by kind, largest first, kinds that used nothing left out."""
    delta = {k: (after[k] - before.get(k, 0.0)) / n * scale for k in after}
    return {k: round(v, 2) for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v > 0}
