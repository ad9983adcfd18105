"""Group snapshots: the setup runs once per group and the other samples start from its snapshot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from orchestrator.backends.docker.backend import DockerBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Environment, Rubric, ScoringContext, Task, ToolInvocation
from orchestrator.core.models import JobSpec, RolloutStatus
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.core.sandbox import Sandbox
from orchestrator.server.app import OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.conftest import TEST_OWNER
from tests.orchestrator.servers import local_runner

# every link in the workspace with its target, one a line: the setup keeps what it left, the scorer compares
LIST_LINKS = 'find . -type l | sort | while read -r l; do echo "$l $(readlink "$l")"; done'


async def _prepared(ctx: ScoringContext) -> float:
    data = await ctx.sandbox.read_file("deps/prepared.txt")
    links = await ctx.sandbox.exec(LIST_LINKS)
    return float(data == b"ready\n" and links.stdout == await ctx.sandbox.read_file("links.txt"))


class SlowSetupEnv(Environment):
    """A setup that costs a second of CPU and leaves files in the workspace (and whatever `extra` leaves)."""

    name = "slow-setup"
    tools = ("bash", "submit")
    snapshot_setup = True
    rubric = Rubric([("prepared", _prepared, 1.0)])

    def __init__(self, extra: str = "true") -> None:
        self.setups = 0
        self.extra = extra

    def tasks(self) -> Sequence[Task]:
        return [
            Task(id=f"t{i}", prompt="submit", reference=(ToolInvocation("submit", {"answer": "x"}),)) for i in range(2)
        ]

    async def setup(self, sandbox: Sandbox, task: Task, seed: int) -> None:
        self.setups += 1
        r = await sandbox.exec(
            "python3 -c 'sum(i*i for i in range(3_000_000))' && mkdir -p deps && echo ready > deps/prepared.txt"
            f" && {self.extra} && ({LIST_LINKS}) > links.txt"
        )
        assert r.exit_code == 0, r.stderr


@pytest.mark.parametrize(
    ("extra", "setups"),
    [
        ("true", 2),
        # links that stay in the workspace are restored as they are (they used to fail every restore, at "/")
        ("ln -s prepared.txt deps/link && ln -s deps top && ln -s ../deps deps/up", 2),
        # a link out of the workspace (a venv's bin/python) is not restored: every sample runs the setup
        ("ln -s /usr/bin/python3 py", 8),
    ],
    ids=["files", "links-inside", "link-outside"],
)
async def test_group_starts_from_one_snapshot(tmp_path: Path, base_image: str, extra: str, setups: int) -> None:
    env = SlowSetupEnv(extra)
    registry = Registry()
    registry.register(env)
    policy = await start_scripted_server(reference_script(env))
    orch = await create_server(
        OrchestratorConfig(port=0, data_dir=tmp_path, backend=DockerBackendConfig(owner=TEST_OWNER)), registry=registry
    )
    try:
        async with EnvfleetClient(orch.address) as client:
            spec = JobSpec(env=env.name, group_size=4, policy=PolicyEndpoint(base_url=policy.url), max_concurrency=8)
            rollouts = [r async for r in client.rollouts(await client.submit(spec))]
        assert len(rollouts) == 8
        assert all(r.status == RolloutStatus.OK and r.reward == 1.0 for r in rollouts), [r.error for r in rollouts]
        assert env.setups == setups, "one setup per group, where the snapshot can be restored"
        assert sum(r.metrics["setup_from_snapshot"] for r in rollouts) == 8 - setups
        assert all(r.attempts == 1 for r in rollouts)
        assert len(local_runner(orch).snapshots) == 0, "snapshots are dropped when the job ends"
    finally:
        await orch.stop()
        await policy.close()


def test_worker_processes_of_one_host_share_its_snapshot_memory() -> None:
    # each worker process held the whole budget in memory: 4 GiB a worker, 64 GiB on a host of 16 workers
    from orchestrator.rollout.snapshots import SnapshotBudget
    from orchestrator.server.worker_plane import _host_share
    from orchestrator.worker.config import WorkerConfig

    whole = SnapshotBudget()
    share = whole.shared_by(16)
    assert share.total_bytes * 16 == whole.total_bytes and share.per_job_bytes < whole.per_job_bytes
    assert share.max_bytes == whole.max_bytes and share.total_bytes >= share.max_bytes  # one snapshot still fits
    config = OrchestratorConfig(data_dir=Path("unused"), workers=16)
    assert WorkerConfig().model_copy(update=_host_share(config, 16)).host_share == 16
