"""The command line and the sync client, as a user runs them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from orchestrator.client.sdk import SyncEnvfleetClient
from orchestrator.server.app import Orchestrator
from orchestrator.testing.scripted_policy import ScriptedServer
from tests.conftest import REPO
from tests.orchestrator.conftest import job


def _envfleet(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_envs_list_and_describe() -> None:
    r = _envfleet("envs", "list")
    assert r.returncode == 0 and "python-tool@1" in r.stdout
    r = _envfleet("envs", "describe", "python-tool")
    assert r.returncode == 0 and "tool python" in r.stdout and "py-000" in r.stdout
    r = _envfleet("envs", "describe", "pyton-tool")
    assert r.returncode != 0 and "did you mean python-tool" in r.stderr


async def test_rollout_command_writes_jsonl(tmp_path: Path, policy_server: ScriptedServer, base_image: str) -> None:
    out = tmp_path / "r.jsonl"
    r = await asyncio.to_thread(
        _envfleet,
        "rollout",
        "--env",
        "python-tool",
        "--tasks",
        "2",
        "--n",
        "2",
        "--policy",
        policy_server.url,
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 4
    assert {x["status"] for x in lines} == {"OK"} and {x["reward"] for x in lines} == {1.0}
    assert "4 rollouts written" in r.stdout


async def test_sync_client(fake_orchestrator: Orchestrator, policy_server: ScriptedServer, task_ids: list[str]) -> None:
    orchestrator = fake_orchestrator

    def run() -> list[str]:
        with SyncEnvfleetClient(orchestrator.address) as c:
            job_id = c.submit(job(policy_server.url, task_ids[:3]))
            got = [r.task_id for r in c.rollouts(job_id)]
            assert c.get_job(job_id).acked == 3
            return got

    assert sorted(await asyncio.to_thread(run)) == sorted(task_ids[:3])
