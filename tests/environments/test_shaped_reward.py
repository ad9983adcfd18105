"""A reward that depends on the episode's length and the answer's format is a weighted rubric component
(environments/python_tool: ShapedPythonToolEnv), scored through real sessions on the fake backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest

from environments.python_tool import ShapedPythonToolEnv, brevity, generate_tasks
from environments.sdk import Episode, Sandbox, ScoringContext, Turn
from integrations.session import AsyncSessions, StepResult
from orchestrator.backends.config import FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.rollout.policy.base import ToolCall
from orchestrator.service.registry import Registry
from tests.conftest import TEST_OWNER
from tests.orchestrator.servers import serve

TASK = generate_tasks()[0]
ANSWER = str(TASK.data["answer"])


def _python(i: int) -> ToolCall:
    return ToolCall(f"call_{i}", "python", json.dumps({"code": "print(1)"}))


async def _episode(tmp_path: Path, actions: list[ToolCall | str]) -> StepResult:
    registry = Registry.from_entry_points()
    registry.register(ShapedPythonToolEnv())
    async with (
        serve(tmp_path / "data", registry, backend=FakeBackendConfig(owner=TEST_OWNER)) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        sessions = AsyncSessions(client)
        opening = await sessions.reset("python-tool-shaped", TASK.id)
        try:
            for action in actions:
                result = await sessions.step(opening.session_id, action)
        finally:
            await sessions.close(opening.session_id)
    assert result.done
    return result


def _submit(answer: str) -> ToolCall:
    return ToolCall("call_s", "submit", json.dumps({"answer": answer}))


async def test_a_short_plain_answer_gets_the_whole_shaped_reward(tmp_path: Path) -> None:
    result = await _episode(tmp_path, [_submit(ANSWER)])
    assert result.reward_components == {"exact_match": 1.0, "brevity": 1.0, "format": 1.0}
    assert result.reward == pytest.approx(1.2)
    assert result.metrics["turns"] == 1.0


async def test_length_and_format_each_cost_their_weight(tmp_path: Path) -> None:
    # four turns (three python calls, then submit), the right answer padded with spaces: exact match ignores the
    # padding, the format component does not
    result = await _episode(tmp_path, [_python(0), _python(1), _python(2), _submit(f" {ANSWER} ")])
    assert result.reward_components == {"exact_match": 1.0, "brevity": pytest.approx(1 - 3 / 7), "format": 0.0}
    assert result.reward == pytest.approx(1.0 + 0.1 * (1 - 3 / 7))
    # a final answer without submit: right, short, but not the format asked for
    result = await _episode(tmp_path, [ANSWER])
    assert result.reward_components["format"] == 0.0 and result.reward == pytest.approx(1.1)


async def test_shaping_pays_nothing_without_the_right_answer(tmp_path: Path) -> None:
    # paid on its own, the shaping paid 0.2 for any answer submitted at once and 0.1 for an empty final answer:
    # more than a try with the tool that failed, so the policy learned to guess
    result = await _episode(tmp_path, [_submit(ANSWER + "1")])
    assert result.reward_components == {"exact_match": 0.0, "brevity": 0.0, "format": 0.0}
    assert result.reward == 0.0
    result = await _episode(tmp_path, [""])
    assert result.reward == 0.0


def test_brevity_bottoms_out_at_zero() -> None:
    def ctx(turns: int) -> ScoringContext:
        episode = Episode(turns=[Turn(role="assistant")] * turns, answer=ANSWER, finish="max_turns")
        return ScoringContext(cast(Sandbox, None), TASK, episode)  # brevity never touches the sandbox

    assert [brevity(8)(ctx(n)) for n in (1, 8, 12)] == [1.0, 0.0, 0.0]
    assert brevity(1)(ctx(1)) == 1.0  # a one-turn budget divides by nothing
