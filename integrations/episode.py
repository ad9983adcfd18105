"""One token-in, token-out episode over SessionService, for a trainer that generates with its own engine (verl).

The trainer's engine samples token ids from token ids; this module keeps them exactly. The first prompt is the
model's chat template rendered with the session's opening messages and tools; after that history is never
re-rendered: each turn's sampled ids are appended as they are (mask 1, their logprobs), the turn's text is parsed
for tool calls with a named parser, each call is one session Step, and the tool results are tokenized as an
observation delta (mask 0, logprob 0.0) by ChatTemplateTokens.

    tokens = ChatTemplateTokens(tokenizer)
    episode = await run_episode(sessions, tokens, get_parser("hermes"), generate, env="python-tool", task_id="py-000")

`generate(prompt_ids, max_tokens)` returns the sampled ids and, when the engine has them, their logprobs and what
ended the sample. A sample the engine did not finish ("abort": a weight sync) is asked for again, and raises
GenerationAborted after GENERATE_TRIES; no call of a sample cut at max_tokens runs. An episode that ends without a
reward to learn from raises EpisodeFailedError, after `infra_retries` fresh tries when the failure was the fleet's
(INFRA_ERROR).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from integrations.session import AsyncSessions, Message, Opening, StepResult
from orchestrator.core.errors import EpisodeFailedError, GenerationAborted
from orchestrator.core.models import RolloutStatus
from orchestrator.rollout.tito import ChatTemplateTokens, ToolCall, ToolParser
from orchestrator.rollout.tito.reasoning import answer_text, parse_turn, prompt_opens_thinking

log = logging.getLogger(__name__)

# what an engine says ended a sample: it did not finish it (vLLM's and SGLang's "abort", verl's "aborted": a weight
# sync cut it), or it cut it at max_tokens; any other value, or none, is a sample the engine ended. The policy
# client's list (rollout/policy/parsing.py) is not importable here: integrations stay on the client and core layers
NOT_FINISHED = frozenset({"abort", "aborted", "error"})
CUT_OFF = frozenset({"length"})
GENERATE_TRIES = 3  # for a turn whose sample the engine did not finish


@dataclass(frozen=True)
class Generated:
    """One assistant turn as the engine sampled it: ids, their logprobs when it returned them, and what ended the
    sample when it says (`finish_reason`: see NOT_FINISHED and CUT_OFF)."""

    ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None


Generate = Callable[[list[int], int], Awaitable[Generated]]


@dataclass
class EpisodeTokens:
    """A finished episode as flat arrays: response = every turn after the first prompt (mask 1 = sampled)."""

    task_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] | None = field(default_factory=list)
    reward: float = 0.0
    status: RolloutStatus = RolloutStatus.OK
    reward_components: dict[str, float] = field(default_factory=dict)
    assistant_turns: int = 0
    tool_turns: int = 0
    out_of_budget: bool = False

    def append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None) -> None:
        """Append one span; logprobs stay None for the whole episode once a sampled span came without them."""
        self.response_ids += ids
        self.response_mask += [mask] * len(ids)
        if self.response_logprobs is not None:
            if logprobs is None:
                self.response_logprobs = None
            else:
                self.response_logprobs += logprobs


def tool_message(call: ToolCall, result: StepResult) -> Message:
    """The chat message of one tool result, as chat templates expect it."""
    return {"role": "tool", "content": result.observation, "tool_call_id": call.id, "name": call.name}


async def _turn(
    sessions: AsyncSessions, session_id: str, content: str, calls: list[ToolCall]
) -> tuple[StepResult, list[Message]]:
    """Step the turn's calls in order (or its answer when it has none); stop at the call that ends the episode."""
    if not calls:
        return await sessions.step(session_id, answer_text(content)), []
    messages: list[Message] = []
    result: StepResult | None = None
    for call in calls:
        result = await sessions.step(session_id, call)
        messages.append(tool_message(call, result))
        if result.done:
            break
    assert result is not None
    return result, messages


async def _attempt(
    sessions: AsyncSessions,
    opening: Opening,
    tokens: ChatTemplateTokens,
    parser: ToolParser,
    generate: Generate,
    response_length: int,
    prompt_length: int | None = None,
) -> EpisodeTokens:
    sid, tools = opening.session_id, opening.tools
    episode = EpisodeTokens(opening.task_id, tokens.prompt_ids(opening.messages, tools))
    if prompt_length is not None and len(episode.prompt_ids) > prompt_length:
        # the prompt is the environment's opening and its tools, not the dataset's row, so a trainer's own filter of
        # long prompts never saw it; past its prompt length the trainer's batch breaks after every sample has run
        raise ValueError(
            f"the opening of {opening.task_id} is {len(episode.prompt_ids)} tokens (messages and tool schemas), over "
            f"the trainer's prompt length of {prompt_length}: raise it (verl: data.max_prompt_length)"
        )
    while True:
        budget = response_length - len(episode.response_ids)
        context = episode.prompt_ids + episode.response_ids
        out = await _finished_sample(generate, context, budget)
        episode.append(out.ids, 1, out.logprobs)
        episode.assistant_turns += 1
        # read as the fleet reads its own tito turns: the token it stopped on dropped, other special tokens kept (a
        # tool-call marker may be one), the thinking first (a call written while thinking is none)
        cut = _cut_off(out, budget, tokens)
        text = tokens.turn_text(out.ids, cut=cut)
        content, calls = parse_turn(parser, text, tools, opened=prompt_opens_thinking(tokens.decode, context))
        if cut:
            calls = []  # a call it was writing may be cut short: none runs, as in the fleet's own tito turns
        result, messages = await _turn(sessions, sid, content, calls)
        if not result.done:
            delta = tokens.observation_ids(messages, tools)
            if not out.ids or out.ids[-1] != tokens.turn_end_id:
                # the engine stopped without the turn's end token (a stop string, another special token): the
                # template's end goes in as an observation token (mask 0), as in the fleet's own tito turns, so the
                # conversation stays well formed
                delta = [tokens.turn_end_id, *delta]
            if len(episode.response_ids) + len(delta) >= response_length:
                # no room for the observation and another turn: the policy ran out of its budget without an
                # answer, which is its own outcome (the rubric scores an empty answer), not a failure
                episode.out_of_budget = True
                result = await sessions.step(sid, "")
            else:
                episode.append(delta, 0, [0.0] * len(delta))
                episode.tool_turns += 1
                continue
        if not result.scored:
            raise result.failure()
        assert result.status is not None and result.reward is not None
        episode.status, episode.reward = result.status, result.reward
        episode.reward_components = result.reward_components
        return episode


def _cut_off(out: Generated, budget: int, tokens: ChatTemplateTokens) -> bool:
    """Whether the sample was cut at its token budget: the engine says so ("length"), or it took the whole budget and
    its last token is no stop token, whatever it says (verl's vLLM server says "completed" for a stop and a cut alike,
    and its SGLang server says nothing)."""
    if out.finish_reason in CUT_OFF:
        return True
    return len(out.ids) >= budget and not (out.ids and out.ids[-1] in tokens.stop_ids)


async def _finished_sample(generate: Generate, prompt_ids: list[int], budget: int) -> Generated:
    """The engine's sample for the turn, checked; one it did not finish (a weight sync aborted it) is asked for again,
    and after GENERATE_TRIES is GenerationAborted: its partial ids are never taken as the policy's turn."""
    for _ in range(GENERATE_TRIES):
        out = await generate(prompt_ids, budget)
        if len(out.ids) > budget:
            raise ValueError(f"the engine sampled {len(out.ids)} tokens for a budget of {budget}")
        if out.logprobs is not None and len(out.logprobs) != len(out.ids):
            raise ValueError(f"the engine returned {len(out.logprobs)} logprobs for {len(out.ids)} tokens")
        if out.finish_reason not in NOT_FINISHED:
            return out
        log.warning("the engine did not finish a sample (finish_reason %r); asking again", out.finish_reason)
    raise GenerationAborted(
        f"the engine did not finish the turn's sample in {GENERATE_TRIES} tries (finish_reason {out.finish_reason!r})"
    )


async def run_episode(
    sessions: AsyncSessions,
    tokens: ChatTemplateTokens,
    parser: ToolParser,
    generate: Generate,
    *,
    env: str,
    task_id: str = "",
    seed: int | None = None,
    max_turns: int = 0,
    response_length: int = 4096,
    infra_retries: int = 1,
    prompt_length: int | None = None,
) -> EpisodeTokens:
    """Run one scored episode (see the module docstring); the session is always closed."""
    if response_length < 1:
        raise ValueError(f"response_length must be >= 1, got {response_length}")
    for attempt in range(infra_retries + 1):
        opening = await sessions.reset(env, task_id, seed=seed, max_turns=max_turns)
        try:
            return await _attempt(sessions, opening, tokens, parser, generate, response_length, prompt_length)
        except EpisodeFailedError as e:
            if e.status != RolloutStatus.INFRA_ERROR or attempt == infra_retries:
                raise
            log.warning("episode on %s failed with %s; retrying on a fresh session", opening.task_id, e)
        finally:
            await sessions.close(opening.session_id)
    raise AssertionError("unreachable")
