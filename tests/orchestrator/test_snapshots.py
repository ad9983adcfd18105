"""Group snapshots: the setup runs once per group and the other samples start from its snapshot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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


async def _prepared(ctx: ScoringContext) -> float:
    data = await ctx.sandbox.read_file("deps/prepared.txt")
    return float(data == b"ready\n")


class SlowSetupEnv(Environment):
    """A setup that costs a second of CPU and leaves files in the workspace."""

    name = "slow-setup"
    tools = ("bash", "submit")
    snapshot_setup = True
    rubric = Rubric([("prepared", _prepared, 1.0)])

    def __init__(self) -> None:
        self.setups = 0

    def tasks(self) -> Sequence[Task]:
        return [
            Task(id=f"t{i}", prompt="submit", reference=(ToolInvocation("submit", {"answer": "x"}),)) for i in range(2)
        ]

    async def setup(self, sandbox: Sandbox, task: Task, seed: int) -> None:
        self.setups += 1
        r = await sandbox.exec(
            "python3 -c 'sum(i*i for i in range(3_000_000))' && mkdir -p deps && echo ready > deps/prepared.txt"
        )
        assert r.exit_code == 0, r.stderr


async def test_group_starts_from_one_snapshot(tmp_path: Path, base_image: str) -> None:
    env = SlowSetupEnv()
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
        assert env.setups == 2, "one setup per group"
        assert sum(r.metrics["setup_from_snapshot"] for r in rollouts) == 6
        assert len(local_runner(orch).snapshots) == 0, "snapshots are dropped when the job ends"
    finally:
        await orch.stop()
        await policy.close()
