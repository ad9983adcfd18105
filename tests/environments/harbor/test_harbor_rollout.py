"""An imported Harbor environment served by a real orchestrator (config `environments` reference): a scripted agent
solves a task in the writable workdir and test.sh scores it; a task whose test.sh writes no reward is ENV_ERROR."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from environments.harbor.cli import import_harbor
from orchestrator.backends.config import DockerBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, RolloutStatus, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.server.app import OrchestratorConfig, create_server
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from tests.conftest import TEST_OWNER
from tests.environments.harbor.test_harbor import _parse, make_task


def bash(cmd: str) -> Step:
    return Step(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": cmd})])


SUBMIT = Step(tool_calls=[ScriptedToolCall(name="submit", arguments={"answer": "done"})])


async def test_rollouts_of_an_imported_environment(
    tmp_path: Path, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    a = make_task(tmp_path / "src", "upper")
    b = make_task(tmp_path / "src", "forgets-reward", test="#!/bin/bash\necho 'no reward written'\n")
    args = _parse(["envs", "import-harbor", str(a), str(b), "--name", "harbor-e2e", "--home", str(home)])
    args.no_validate = True  # forgets-reward cannot validate; the import is the registrable form under test
    assert import_harbor(args, Console(file=io.StringIO())) == 0
    monkeypatch.setenv("ENVFLEET_HARBOR_HOME", str(home))
    solve = "tr a-z A-Z < greeting.txt > out.txt && mkdir -p src && echo x > /app/src/marker"
    script = Script(
        tasks={
            "upper": [bash(solve), SUBMIT],
            "forgets-reward": [bash(solve + " && echo 1 > /logs/verifier/reward.txt"), SUBMIT],
        }
    )
    server = await start_scripted_server(script)
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=DockerBackendConfig(owner=TEST_OWNER),
            environments=["environments.harbor.installed:harbor-e2e"],
        )
    )
    try:
        async with EnvfleetClient(orch.address) as client:
            spec = JobSpec(
                env="harbor-e2e",
                tasks=TaskSelection(kind="ids", ids=["upper", "forgets-reward"]),
                policy=PolicyEndpoint(base_url=server.url),
            )
            rollouts = {r.task_id: r async for r in client.rollouts(await client.submit(spec))}
    finally:
        await orch.stop(grace=1)
        await server.close()
    ok = rollouts["upper"]
    assert ok.status == RolloutStatus.OK and ok.reward == 1.0, ok.error
    broken = rollouts["forgets-reward"]
    assert broken.status == RolloutStatus.ENV_ERROR, (broken.status, broken.reward)
    assert broken.reward is None  # never a 0
    # the reward the agent planted in /logs/verifier was cleared before test.sh ran
    assert broken.error is not None and "neither /logs/verifier/reward.txt" in broken.error.message
