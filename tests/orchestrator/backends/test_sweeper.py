"""Owner liveness as the sweep judges it: a live process is alive, a gone or zombie one is not."""

from __future__ import annotations

import os
import subprocess
import time

from orchestrator.core.processes import owner_alive, proc_start_time


def test_a_zombie_owner_is_dead() -> None:
    # a killed worker whose control plane died with it may stay a zombie until someone reaps it; its sandboxes must
    # be swept all the same
    child = subprocess.Popen(["true"])
    start = proc_start_time(child.pid)
    assert start and owner_alive(os.getpid(), proc_start_time(os.getpid()))
    for _ in range(200):  # exited but not reaped: a zombie
        if open(f"/proc/{child.pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0] == b"Z":
            break
        time.sleep(0.01)
    assert not owner_alive(child.pid, start)
    child.wait()
    assert not owner_alive(child.pid, start)
