"""A command that fills its sandbox's memory with many small processes loses them to the OOM killer, not envd, on
real sandboxes, each envd in turn.

The killer takes the process with the most memory. envd holds about 9 MB (the compiled one; the Python one about
30), so a command whose memory was spread over processes smaller than that (a parallel build, a test runner's
workers, or a policy's doing) made envd the victim: the sandbox died with it, and the rollout was INFRA_ERROR, a
retry. Every command now starts with oom_score_adj 1000 (the whole limit added to its score), envd with 0.
"""

from __future__ import annotations

import pytest

from orchestrator.core.sandbox import Limits, SandboxSpec
from tests.conftest import owned_backend

# 80 shells of about 5 MB each (a 4 MiB string: dash's memory, no other process) under a 256 MB limit: each is
# smaller than envd, and together they are over the limit; the shell counts the ones the killer took
SPREAD = """
pids=""
for i in $(seq 80); do
  sh -c 'x=a; for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22; do x=$x$x; done; sleep 8' &
  pids="$pids $!"
done
killed=0
for p in $pids; do wait $p || killed=$((killed + 1)); done
echo "killed $killed"
"""


@pytest.mark.parametrize("impl", ["go", "python"])
async def test_many_small_processes_over_the_memory_limit_are_killed_before_envd(impl: str, base_image: str) -> None:
    spec = SandboxSpec(image=base_image, limits=Limits(memory_mb=256, pids=256, tmp_mb=8, workspace_mb=8))
    async with owned_backend(envd=impl) as backend, await backend.create(spec) as s:
        # set once the command has exec'd, and on what it forked before that (envd/go/child.go, firstToGo)
        r = await s.exec("sleep 0.2; cat /proc/self/oom_score_adj /proc/1/oom_score_adj")
        assert r.stdout == b"1000\n0\n"
        r = await s.exec(["/bin/sh", "-c", SPREAD], timeout=120)
        killed = int(r.stdout.split()[-1])
        assert killed > 0, r.stdout  # the limit was reached: the killer had to choose
        assert (await s.exec("echo alive")).stdout == b"alive\n"
        assert (await s.state()).running
        assert (await s.reset()).ok
