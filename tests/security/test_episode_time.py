"""A policy cannot spend its way to a masked rollout. A rollout's time (rollout_timeout_s) covered its sandbox, its
setup, its episode and its scoring alike, and ran out as TIMEOUT, which carries no reward and is masked from training:
a losing policy gained by making slow tool calls (each up to the tool's timeout, as many a turn as it liked) until
the time was gone. Its tool calls now end when only the scoring's reserve is left (a quarter of the rollout's time,
at most 300 s), and the episode with them: TRUNCATED ("time"), and scored. A generation is not cut: a hung inference
server is no outcome of the policy's, and stays TIMEOUT (tests/orchestrator/test_e2e.py).

Through real processes: the scripted policy server and the real gRPC server on the fake backend, whose every command
takes 2 s."""

from __future__ import annotations

import asyncio
from pathlib import Path

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import RolloutStatus
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, serve


async def test_a_policy_that_spends_the_rollouts_time_is_truncated_and_scored(tmp_path: Path) -> None:
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    slow = Step(tool_calls=[ScriptedToolCall(name="python", arguments={"code": "print(1)"})])
    script = Script(default=[slow] * 8)  # a tool call a turn, 2 s each, for python-tool's 8 turns: 16 s
    async with (
        await start_scripted_server(script, tokens=False) as scripted,
        serve(tmp_path / "data", backend=FAKE.model_copy(update={"exec_latency_s": 2.0})) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        # 8 s in all: the episode ends when 2 s are left (a quarter), three calls in
        job_id = await client.submit(job(scripted.url, [task_id], rollout_timeout_s=8, max_infra_retries=0))
        async with asyncio.timeout(60):
            [rollout] = [r async for r in client.rollouts(job_id)]
    assert (rollout.status, rollout.reward, rollout.error) == (RolloutStatus.TRUNCATED, 0.0, None)
    assert rollout.timing is not None and 5.5 < rollout.timing.total < 8
    calls = [c for t in rollout.turns if t.role == "assistant" for c in t.tool_calls or ()]
    answered = [t for t in rollout.turns if t.role == "tool"]
    assert len(answered) in (2, 3) and len(calls) == len(answered) + 1  # the call the deadline cut has no answer
