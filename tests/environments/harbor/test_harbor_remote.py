"""Harbor tasks registered on a remote server (`envfleet envs import-harbor --server`): the task directories go as an
archive, the server validates them as a local import does (each oracle passes, an empty solution fails), and the
environment runs jobs like any other, in the control plane and, after a restart that reloads it, on worker processes;
rewards follow Harbor's rules (reward.txt, or the mean of reward.json's keys), and a reward the agent planted in
/logs/verifier is cleared before test.sh runs, and a validated task whose test.sh the agent's program held past its
timeout scores 0 on either (the server and each worker know a registered archive passed validation)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, Rollout, RolloutStatus, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.testing.scripted_policy import Script, ScriptedServer, start_scripted_server
from protos import orchestrator_pb2 as pb
from tests.conftest import REPO
from tests.environments.harbor.test_harbor import TEST_JSON, make_task
from tests.environments.harbor.test_harbor_rollout import SUBMIT, bash
from tests.orchestrator.servers import expect_error, serve
from tests.security.test_grader_harbor import HANG, ORACLE, VERDICT_SH

TOKEN = secrets.token_urlsafe(24)
SOLVE = "tr a-z A-Z < greeting.txt > out.txt && mkdir -p src && echo x > /app/src/marker"
# upper-json half done: out.txt right, no marker; and a reward.txt planted where test.sh writes (it would win)
HALF = "tr a-z A-Z < greeting.txt > out.txt && mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"tokens:\n  {TOKEN}: team-a\n")
    return path


@pytest.fixture
def task_dirs(tmp_path: Path) -> list[Path]:
    return [
        make_task(tmp_path / "src", "upper-txt"),
        make_task(tmp_path / "src", "upper-json", test=TEST_JSON),
        make_task(tmp_path / "src", "hang", test=VERDICT_SH, solve=ORACLE, verifier_timeout=3),
    ]


@pytest.fixture
async def policy() -> AsyncIterator[ScriptedServer]:
    script = Script(
        tasks={"upper-txt": [bash(SOLVE), SUBMIT], "upper-json": [bash(HALF), SUBMIT], "hang": [bash(HANG), SUBMIT]}
    )
    server = await start_scripted_server(script)
    try:
        yield server
    finally:
        await server.close()


async def envfleet(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The real command line in a process of its own: its exit code and its output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orchestrator.cli",
        *argv,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=900)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


async def _import_remote(address: str, task_dirs: list[Path], token: Path) -> tuple[int, str]:
    """`envfleet envs import-harbor` of the tasks as remote-harbor, onto the server at `address`."""
    argv = ("envs", "import-harbor", *map(str, task_dirs), "--name", "remote-harbor")
    return await envfleet(*argv, "--server", address, "--token-file", str(token))


async def _job(address: str, policy_url: str) -> dict[str, Rollout]:
    async with EnvfleetClient(address, token=TOKEN) as client:
        spec = JobSpec(
            env="remote-harbor",
            tasks=TaskSelection(kind="ids", ids=["upper-txt", "upper-json", "hang"]),
            policy=PolicyEndpoint(base_url=policy_url),
        )
        return {r.task_id: r async for r in client.rollouts(await client.submit(spec))}


def _check_rewards(rollouts: dict[str, Rollout]) -> None:
    txt, js = rollouts["upper-txt"], rollouts["upper-json"]
    assert txt.status == RolloutStatus.OK and txt.reward == 1.0, txt.error
    # reward.json's keys: correct 1, marker 0, style 0.5 -> their mean; the planted reward.txt (1) was cleared
    assert js.status == RolloutStatus.OK, js.error
    assert js.reward == pytest.approx(0.5)
    assert js.reward_components == {"correct": 1.0, "marker": 0.0, "style": 0.5}
    hang = rollouts["hang"]  # test.sh timed out on the agent's program: its 0, not a masked ENV_ERROR
    assert hang.status == RolloutStatus.OK and hang.reward == 0.0, (hang.status, hang.error)
    assert hang.metrics["verifier_failed_after_agent"] == 1.0


async def test_register_remotely_then_run_jobs_in_process_and_on_workers(
    tmp_path: Path, base_image: str, token_file: Path, task_dirs: list[Path], policy: ScriptedServer
) -> None:
    data = tmp_path / "data"
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    security = {"token_file": token_file}
    async with serve(data, security=security) as orch:
        code, out = await _import_remote(orch.address, task_dirs, token)
        assert code == 0, out
        assert "registered remote-harbor@1" in out and "3 task(s) validated" in out, out
        async with EnvfleetClient(orch.address, token=TOKEN) as client:
            info = await client.env_stub.Describe(pb.DescribeEnvironmentRequest(name="remote-harbor"))
            assert (info.source, info.num_tasks) == ("archive:harbor", 3)
            assert {t.name for t in info.tools} >= {"bash", "write_file", "submit"}
            # the same archive again is a no-op; other content under the same version is refused
            code, out = await _import_remote(orch.address, task_dirs, token)
            assert code == 0, out
            (task_dirs[0] / "instruction.md").write_text("Something else.\n")
            code, out = await _import_remote(orch.address, task_dirs, token)
            assert code == 1 and "ALREADY_EXISTS" in out and "bump the version" in out, out
        _check_rewards(await _job(orch.address, policy.url))
    stored = list((data / "environments" / "archives" / "team-a").glob("remote-harbor@1.*"))
    assert sorted(p.suffix for p in stored) == [".json", ".tar"]

    # a restart reloads it from the tenant's folder; now the rollouts run on a worker process
    async with serve(data, security=security, workers=1) as orch:
        assert orch.workers is not None
        await orch.workers.hub.wait_for_workers(1, timeout_s=120)
        _check_rewards(await _job(orch.address, policy.url))
        assert sum(w.served for w in orch.workers.hub.workers()) == 3

    # a record of an older version, validated under older rules (its tasks ran in /app, their scripts under bash, the
    # agent's time per tool call): what that proved is not known now, so it runs as not validated, on the control
    # plane and on its workers, and the verifier that timed out on the agent's program is ENV_ERROR, not a 0
    [record] = [p for p in stored if p.suffix == ".json"]
    raw = json.loads(record.read_text())
    assert raw.pop("rules") == "2"
    record.write_text(json.dumps(raw))
    async with serve(data, security=security, workers=1) as orch:
        assert orch.workers is not None
        await orch.workers.hub.wait_for_workers(1, timeout_s=120)
        rollouts = await _job(orch.address, policy.url)
        # the same archive again is no longer a silent no-op: it says the registration runs unvalidated, and how to
        # validate it again
        (task_dirs[0] / "instruction.md").write_text("Write greeting.txt in upper case to out.txt.\n")
        code, out = await _import_remote(orch.address, task_dirs, token)
        assert code == 1 and "FAILED_PRECONDITION" in out and "register it under a new version" in out, out
    assert rollouts["upper-txt"].status == RolloutStatus.OK and rollouts["upper-txt"].reward == 1.0
    assert rollouts["hang"].status == RolloutStatus.ENV_ERROR and rollouts["hang"].reward is None


async def test_a_failing_oracle_is_refused_by_the_server(tmp_path: Path, base_image: str) -> None:
    bad = make_task(tmp_path / "src", "wrong-oracle", solve="#!/bin/bash\necho nope > out.txt\n")
    ok = make_task(tmp_path / "src", "fine")
    from environments.harbor.archive import pack

    archive = pb.EnvironmentArchive(kind="harbor", name="bad-oracle", archive=pack([ok, bad]))
    async with serve(tmp_path / "data") as orch, EnvfleetClient(orch.address) as client:
        await expect_error(
            client.env_stub.RegisterArchive(archive),
            grpc.StatusCode.FAILED_PRECONDITION,
            "task wrong-oracle: oracle (solution/solve.sh) does not pass: reward 0",
        )
        names = {e.name for e in (await client.env_stub.List(pb.ListEnvironmentsRequest())).environments}
        assert "bad-oracle" not in names
        assert not list((tmp_path / "data" / "environments" / "archives" / "local").glob("bad-oracle*"))
        # the good task alone validates (a dry run: nothing registered)
        report = await client.env_stub.ValidateArchive(
            pb.EnvironmentArchive(kind="harbor", name="bad-oracle", archive=pack([ok]))
        )
        assert [(t.task_id, t.reference_reward, t.empty_reward) for t in report.tasks] == [("fine", 1.0, 0.0)]
        names = {e.name for e in (await client.env_stub.List(pb.ListEnvironmentsRequest())).environments}
        assert "bad-oracle" not in names
