"""The tito episode driver behind the verl adapter, over real sessions: exact sampled ids and logprobs (mask 1),
observation deltas from the chat template (mask 0), the episode's reward, and the budget."""

from __future__ import annotations

from typing import Any

import pytest

from integrations.episode import EpisodeTokens, Generated, answer_text, run_episode
from integrations.session import AsyncSessions
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import EpisodeFailedError
from orchestrator.core.models import RolloutStatus
from orchestrator.rollout.tito import ChatTemplateTokens, get_parser
from orchestrator.server.app import Orchestrator
from orchestrator.service.registry import Registry
from tests.integrations.conftest import ENV
from tests.integrations.engine import ScriptedEngine


@pytest.fixture
def tokens() -> ChatTemplateTokens:
    from transformers import AutoTokenizer

    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    return ChatTemplateTokens(AutoTokenizer.from_pretrained(QWEN_LIKE_DIR))


@pytest.fixture
def engine(tokens: ChatTemplateTokens, registry: Registry) -> ScriptedEngine:
    return ScriptedEngine(tokens.tokenizer, {t.id: str(t.data["answer"]) for t in registry.get(ENV).tasks()})


async def _run(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: ScriptedEngine, **kw: Any
) -> EpisodeTokens:
    async def generate(prompt_ids: list[int], max_tokens: int) -> Generated:
        s = engine.sample("e1:py-003:0", prompt_ids, max_tokens)
        return Generated(s.ids, s.logprobs)

    async with EnvfleetClient(orchestrator.address) as client:
        return await run_episode(
            AsyncSessions(client), tokens, get_parser("hermes"), generate, env=ENV, task_id="py-003", **kw
        )


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of the mask."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


async def test_an_episode_keeps_the_sampled_ids_exactly(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: ScriptedEngine, registry: Registry
) -> None:
    episode = await _run(orchestrator, tokens, engine)
    assert episode.status == RolloutStatus.OK and episode.reward == 1.0
    assert episode.reward_components == {"exact_match": 1.0}
    assert (episode.assistant_turns, episode.tool_turns) == (2, 1)
    first, second = engine.samples
    env = registry.get(ENV)
    task = next(t for t in env.tasks() if t.id == "py-003")
    # the first prompt is the chat template over the opening messages and the tools
    assert episode.prompt_ids == first.prompt_ids
    prompt = tokens.decode(episode.prompt_ids)
    assert '"name": "submit"' in prompt and task.prompt in prompt
    # sampled, observation, sampled: the sampled spans are the engine's ids and logprobs, untouched
    spans = _spans(episode.response_mask)
    assert [s[0] for s in spans] == [1, 0, 1]
    (_, a, b), (_, c, d), (_, e, f) = spans
    assert episode.response_ids[a:b] == first.ids and episode.response_ids[e:f] == second.ids
    assert episode.response_logprobs is not None
    assert episode.response_logprobs[a:b] == first.logprobs and episode.response_logprobs[e:f] == second.logprobs
    assert episode.response_logprobs[c:d] == [0.0] * (d - c)
    # the observation is the template's delta for the tool result; the second prompt is everything so far
    observation = tokens.decode(episode.response_ids[c:d])
    assert "<tool_response>" in observation and observation.rstrip().endswith("<|im_start|>assistant")
    assert second.prompt_ids == episode.prompt_ids + episode.response_ids[:d]
    # re-rendering the history would not give these ids back: the template drops the first turn's thinking
    assert "Let me think" in tokens.decode(episode.response_ids)


async def test_out_of_budget_ends_the_episode_as_the_policys_own_outcome(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: ScriptedEngine
) -> None:
    # room for the first turn only: no observation is appended and the episode ends with an empty answer
    budget = len(engine.sample("probe:py-003:0", [], 10_000).ids) + 5
    engine.samples.clear()
    episode = await _run(orchestrator, tokens, engine, response_length=budget)
    assert episode.out_of_budget and episode.reward == 0.0 and episode.status == RolloutStatus.OK
    assert set(episode.response_mask) == {1} and len(episode.response_ids) <= budget


async def test_bad_engine_output_and_bad_arguments_are_refused(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: ScriptedEngine
) -> None:
    async def garbage(prompt_ids: list[int], max_tokens: int) -> Generated:
        return Generated([1, 2, 3], [-0.1])

    async with EnvfleetClient(orchestrator.address) as client:
        with pytest.raises(ValueError, match="returned 1 logprobs for 3 tokens"):
            await run_episode(AsyncSessions(client), tokens, get_parser("hermes"), garbage, env=ENV, task_id="py-000")
        with pytest.raises(ValueError, match="response_length must be >= 1"):
            await run_episode(AsyncSessions(client), tokens, get_parser("hermes"), garbage, env=ENV, response_length=0)
    err = EpisodeFailedError("INFRA_ERROR", "sandbox", "died")
    assert err.status == "INFRA_ERROR" and "episode ended with INFRA_ERROR: sandbox: died" in str(err)


def test_the_answer_drops_the_reasoning() -> None:
    assert answer_text("<think>\nhmm\n</think>\n\n 42 ") == "42"
    assert answer_text("<think>never closed") == ""
