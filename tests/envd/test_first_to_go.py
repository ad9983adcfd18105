"""The Python envd's OOM order (envd/child.py first_to_go) on a real process tree on the host; the compiled envd's
firstToGo has the same test in envd/go/child_test.go (tests/envd/test_go.py), and tests/security/test_envd_memory.py
runs both in real sandboxes under a memory limit."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from envd.child import _children, first_to_go


def _adj(pid: int) -> str:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return f.read().strip()


@pytest.fixture
def command_tree() -> Iterator[list[int]]:
    """A command that forked a child and a grandchild before envd's write (its pids, the command's first)."""
    proc = subprocess.Popen(["/bin/sh", "-c", "sleep 60 & sh -c 'sleep 60 & wait' & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            tree = [proc.pid]
            for pid in tree:
                tree.extend(_children(pid))
            if len(tree) >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert len(tree) == 4, f"the command's tree did not come up: {tree}"
        yield tree
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_what_the_command_forked_before_the_write_goes_first_too(command_tree: list[int]) -> None:
    # a shell's workers started in its first milliseconds, while envd waited for a core, kept envd's 0: enough of
    # them filled the limit, and envd, the largest at 0, was killed (the sandbox with it: an INFRA_ERROR retry)
    assert "1000" not in {_adj(pid) for pid in command_tree}
    first_to_go(command_tree[0])
    assert {pid: _adj(pid) for pid in command_tree} == dict.fromkeys(command_tree, "1000")


def test_a_command_gone_already_is_no_error() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    first_to_go(proc.pid)  # reaped: no /proc entry, nothing to write
