"""The tito episode driver behind the verl adapter, over real sessions, with the model server double as the engine:
exact sampled ids and logprobs (mask 1, the double's log), observation deltas from the chat template (mask 0, the
template's own rendering), the episode's reward, and the budget."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from integrations.episode import EpisodeTokens, Generated, run_episode
from integrations.session import AsyncSessions
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import EpisodeFailedError, GenerationAborted
from orchestrator.core.models import RolloutStatus
from orchestrator.rollout.tito import ChatTemplateTokens, get_parser
from orchestrator.rollout.tito.reasoning import answer_text
from orchestrator.server.app import Orchestrator
from orchestrator.service.registry import Registry
from orchestrator.testing.qwen_like import thinking_in_prompt
from orchestrator.testing.scripted_policy import Script, ScriptedServer, Step, start_scripted_server
from tests.integrations.conftest import ENV
from tests.integrations.engine import DoubleEngine
from tests.integrations.exact import assert_sampled, observation_text, samples_of

TASK = "py-003"
REQUEST = f"e1:{TASK}:0"  # the double's `user`: the task in the middle picks its script


@pytest.fixture
def tokens() -> ChatTemplateTokens:
    from transformers import AutoTokenizer

    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    return ChatTemplateTokens(AutoTokenizer.from_pretrained(QWEN_LIKE_DIR))


@pytest.fixture
async def engine(qwen_server: ScriptedServer) -> AsyncIterator[DoubleEngine]:
    async with httpx.AsyncClient() as http:
        yield DoubleEngine(qwen_server, http)


async def _run(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: DoubleEngine, **kw: Any
) -> EpisodeTokens:
    async def generate(prompt_ids: list[int], max_tokens: int) -> Generated:
        return await engine.generate(REQUEST, prompt_ids, max_tokens)

    async with EnvfleetClient(orchestrator.address) as client:
        return await run_episode(
            AsyncSessions(client), tokens, get_parser("hermes"), generate, env=ENV, task_id=TASK, **kw
        )


async def test_an_episode_keeps_the_sampled_ids_exactly(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: DoubleEngine, registry: Registry
) -> None:
    episode = await _run(orchestrator, tokens, engine)
    assert episode.status == RolloutStatus.OK and episode.reward == 1.0
    assert episode.reward_components == {"exact_match": 1.0}
    assert (episode.assistant_turns, episode.tool_turns) == (2, 1)
    samples = samples_of(engine.server, REQUEST)
    assert [s.turn for s in samples] == [0, 1]  # the double read each turn off the prompt the driver built
    task = next(t for t in registry.get(ENV).tasks() if t.id == TASK)
    # the first prompt is the chat template over the opening messages and the tools
    prompt = tokens.decode(episode.prompt_ids)
    assert '"name": "submit"' in prompt and task.prompt in prompt
    # sampled, observation, sampled: the double's ids and logprobs untouched, the mask 1 exactly on them
    (observation,) = assert_sampled(
        episode.prompt_ids, episode.response_ids, episode.response_mask, episode.response_logprobs, samples
    )
    # the observation is the template's delta for the tool result (the fake backend echoes the code)
    assert observation == tokens.encode(observation_text(str(task.reference[0].arguments["code"])))
    # the double's sample is not the tokenizer's: decoding and re-encoding would change the ids
    assert tokens.encode(tokens.decode(samples[0].ids)) != samples[0].ids
    # re-rendering the history would not give these ids back either: the template drops the first turn's thinking
    assert "<think>" in tokens.decode(samples[0].ids) and '{"name":"python",  "arguments"' in tokens.decode(
        episode.response_ids
    )


async def test_a_thinking_the_prompt_opened_is_no_answer(
    orchestrator: Orchestrator, registry: Registry, tmp_path: Path
) -> None:
    # the template ends its generation prompt with `<think>\n` (DeepSeek-R1, Qwen3-Thinking-2507): the model writes
    # only the close, and the plain answer the grader read held the thinking (a right answer scored 0)
    from transformers import AutoTokenizer

    task = next(t for t in registry.get(ENV).tasks() if t.id == TASK)
    script = Script(template="qwen3", model="qwen-like", tasks={TASK: [Step(content=str(task.data["answer"]))]})
    tokens = ChatTemplateTokens(AutoTokenizer.from_pretrained(thinking_in_prompt(tmp_path)))
    server = await start_scripted_server(script)
    try:
        async with httpx.AsyncClient() as http:
            episode = await _run(orchestrator, tokens, DoubleEngine(server, http))
    finally:
        await server.close()
    assert (episode.status, episode.reward, episode.assistant_turns) == (RolloutStatus.OK, 1.0, 1)
    (sample,) = samples_of(server, REQUEST)
    assert "<think>" not in tokens.decode(sample.ids) and "</think>" in tokens.decode(sample.ids)
    assert_sampled(episode.prompt_ids, episode.response_ids, episode.response_mask, episode.response_logprobs, [sample])


async def test_out_of_budget_ends_the_episode_as_the_policys_own_outcome(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: DoubleEngine
) -> None:
    # room for the first turn only: no observation is appended and the episode ends with an empty answer
    first_step = engine.server.script.tasks[TASK][0]
    first, _, _ = engine.server.app.model.sample(REQUEST, 0, first_step, None)
    budget = len(first) + 5
    episode = await _run(orchestrator, tokens, engine, response_length=budget)
    assert episode.out_of_budget and episode.reward == 0.0 and episode.status == RolloutStatus.OK
    (sample,) = samples_of(engine.server, REQUEST)
    assert sample.ids == first and engine.requests[0]["max_tokens"] == budget
    assert_sampled(episode.prompt_ids, episode.response_ids, episode.response_mask, episode.response_logprobs, [sample])


async def test_bad_engine_output_and_bad_arguments_are_refused(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens
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


async def test_a_sample_the_engine_did_not_finish_is_asked_for_again_never_taken(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: DoubleEngine
) -> None:
    # a weight sync aborts the first try at the first turn: its partial ids (the correct call's first half) are
    # dropped, the turn is sampled again, and the episode is the one the engine finished
    asked: list[int] = []

    async def aborted_once(prompt_ids: list[int], max_tokens: int) -> Generated:
        out = await engine.generate(REQUEST, prompt_ids, max_tokens)
        asked.append(len(prompt_ids))
        if len(asked) == 1:
            return Generated(
                out.ids[: len(out.ids) // 2], out.logprobs and out.logprobs[: len(out.ids) // 2], "aborted"
            )
        return Generated(out.ids, out.logprobs, "completed")

    async with EnvfleetClient(orchestrator.address) as client:
        sessions = AsyncSessions(client)
        episode = await run_episode(sessions, tokens, get_parser("hermes"), aborted_once, env=ENV, task_id=TASK)
        assert episode.status == RolloutStatus.OK and episode.reward == 1.0
        assert asked[0] == asked[1], "the aborted turn was asked for again from the same prompt"
        assert episode.assistant_turns == 2

        async def always_aborted(prompt_ids: list[int], max_tokens: int) -> Generated:
            return Generated([1, 2], [-0.5, -0.5], "abort")

        with pytest.raises(
            GenerationAborted, match=r"did not finish the turn's sample in 3 tries \(finish_reason 'abort'\)"
        ):
            await run_episode(sessions, tokens, get_parser("hermes"), always_aborted, env=ENV, task_id=TASK)


async def test_no_call_of_a_sample_cut_at_max_tokens_runs(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: DoubleEngine
) -> None:
    # the engine says "length" on a turn whose text parses as a call: the call is not stepped, the turn's text is
    # the answer, and the episode is scored on it
    async def cut(prompt_ids: list[int], max_tokens: int) -> Generated:
        out = await engine.generate(REQUEST, prompt_ids, max_tokens)
        return Generated(out.ids, out.logprobs, "length")

    async with EnvfleetClient(orchestrator.address) as client:
        episode = await run_episode(AsyncSessions(client), tokens, get_parser("hermes"), cut, env=ENV, task_id=TASK)
    assert (episode.assistant_turns, episode.tool_turns) == (1, 0)
    assert episode.reward == 0.0


async def test_no_call_of_a_sample_that_took_its_whole_budget_runs_whatever_the_engine_says(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: DoubleEngine
) -> None:
    # verl's vLLM server says "completed" for a sample cut at max_tokens as for one that stopped (its SGLang server
    # says nothing): the cut, half-written call was stepped. A sample that took its whole budget and ends on no stop
    # token was cut there, whatever the engine says
    firsts: list[int] = []

    async def completed(prompt_ids: list[int], max_tokens: int) -> Generated:
        out = await engine.generate(REQUEST, prompt_ids, max_tokens)
        firsts.append(len(out.ids))
        return Generated(out.ids, out.logprobs, "completed")

    async with EnvfleetClient(orchestrator.address) as client:
        whole = await run_episode(AsyncSessions(client), tokens, get_parser("hermes"), completed, env=ENV, task_id=TASK)
        assert whole.tool_turns == 1 and whole.reward == 1.0  # the first turn's call ran: it was not cut
        n = firsts[0]
        sessions = AsyncSessions(client)
        stepped: list[object] = []
        step = sessions.step

        async def recorded(session_id: str, action: Any) -> Any:
            stepped.append(action)
            return await step(session_id, action)

        sessions.step = recorded  # type: ignore[method-assign]
        episode = await run_episode(
            sessions, tokens, get_parser("hermes"), completed, env=ENV, task_id=TASK, response_length=n - 3
        )
    assert all(isinstance(a, str) for a in stepped), stepped  # final answers only: no call ran
    assert episode.assistant_turns == 1 and episode.tool_turns == 0 and episode.reward == 0.0


async def test_an_opening_longer_than_the_trainers_prompt_length_is_refused_before_any_sample(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: DoubleEngine
) -> None:
    # the prompt is the environment's opening and its tools, not the dataset's row, so verl's own filter of long
    # prompts never saw it: past rollout.prompt_length, its batch broke after every sample had used its sandbox
    asked: list[int] = []

    async def generate(prompt_ids: list[int], max_tokens: int) -> Generated:
        asked.append(len(prompt_ids))
        return await engine.generate(REQUEST, prompt_ids, max_tokens)

    async with EnvfleetClient(orchestrator.address) as client:
        with pytest.raises(
            ValueError, match=r"tokens \(messages and tool schemas\), over the trainer's prompt length of 64"
        ):
            await run_episode(
                AsyncSessions(client), tokens, get_parser("hermes"), generate, env=ENV, task_id=TASK, prompt_length=64
            )
        assert asked == []
        assert orchestrator.sessions is not None and orchestrator.sessions.open_sessions() == 0
        episode = await run_episode(
            AsyncSessions(client), tokens, get_parser("hermes"), generate, env=ENV, task_id=TASK, prompt_length=1024
        )
    assert episode.reward == 1.0


async def test_a_turn_that_stopped_before_its_end_token_gets_it_from_the_template(
    orchestrator: Orchestrator, tokens: ChatTemplateTokens, engine: DoubleEngine
) -> None:
    # an engine stopped by a stop string (or a special token other than the turn's end) returns a sample without
    # the end token: the observation went straight after it, and the conversation verl trained on had an assistant
    # turn that never ended. The fleet's own tito turns put the end token in (mask 0), and so does the episode now
    firsts: list[Generated] = []

    async def stopped_early(prompt_ids: list[int], max_tokens: int) -> Generated:
        out = await engine.generate(REQUEST, prompt_ids, max_tokens)
        assert out.ids[-1] == tokens.turn_end_id and out.logprobs is not None
        firsts.append(out)
        return Generated(out.ids[:-1], out.logprobs[:-1], "stop")

    async with EnvfleetClient(orchestrator.address) as client:
        episode = await run_episode(
            AsyncSessions(client), tokens, get_parser("hermes"), stopped_early, env=ENV, task_id=TASK
        )
    assert episode.status == RolloutStatus.OK and episode.reward == 1.0  # the double read turn 1 off a right prompt
    n = len(firsts[0].ids) - 1
    assert episode.response_ids[: n + 1] == [*firsts[0].ids[:n], tokens.turn_end_id]
    assert episode.response_mask[: n + 1] == [1] * n + [0]
    assert episode.response_logprobs is not None and episode.response_logprobs[n] == 0.0


async def test_a_step_the_fleet_failed_is_an_infrastructure_failure_of_the_episode(orchestrator: Orchestrator) -> None:
    # a Step on a session the fleet lost (expired, a restart) went up as a bare gRPC error and failed the trainer's
    # whole generation batch, where run_episode retries an INFRA_ERROR on a fresh session
    async with EnvfleetClient(orchestrator.address) as client:
        sessions = AsyncSessions(client)
        opening = await sessions.reset(ENV, TASK)
        await sessions.close(opening.session_id)
        with pytest.raises(EpisodeFailedError) as e:
            await sessions.step(opening.session_id, "42")
    assert e.value.status == "INFRA_ERROR" and e.value.kind == "NOT_FOUND"


async def test_a_step_and_a_close_after_the_server_went_are_the_fleets_failure(tmp_path: Any) -> None:
    # the server gone: the step's UNAVAILABLE went up bare, and the close in run_episode's cleanup raised it again in
    # place of the episode's INFRA_ERROR, so no retry on a fresh session ever ran
    from tests.orchestrator.servers import FAKE, serve

    async with serve(tmp_path / "data", backend=FAKE) as orch:
        address = orch.address
        async with EnvfleetClient(address) as client:
            opening = await AsyncSessions(client).reset(ENV, TASK)
    async with EnvfleetClient(address) as client:
        sessions = AsyncSessions(client, step_timeout_s=5)
        with pytest.raises(EpisodeFailedError) as e:
            await sessions.step(opening.session_id, "42")
        assert e.value.status == "INFRA_ERROR" and e.value.kind in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
        await sessions.close(opening.session_id)  # no raise: its idle expiry (here: the stop) released it
