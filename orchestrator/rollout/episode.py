"""The agent loop of one episode: policy call -> parse tool calls -> run them in the sandbox (the one step in
orchestrator/rollout/step.py) -> observation, until submit, a stop, or a limit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from orchestrator.core.environment import Environment, Episode, Finish, Task
from orchestrator.core.models import ToolCallRecord, Turn
from orchestrator.core.policy import Sampling
from orchestrator.core.sandbox import Sandbox
from orchestrator.rollout.policy.base import ContextFull, Policy
from orchestrator.rollout.step import EpisodeState, opening_turns, record_assistant, run_tool_call
from orchestrator.rollout.tokens import TokenTracker


@dataclass
class EpisodeResult:
    """The episode plus what the runner reports around it."""

    episode: Episode
    tokens: TokenTracker
    generation_s: float
    tools_s: float
    policy_model: str


async def run_episode(
    env: Environment,
    task: Task,
    sandbox: Sandbox,
    policy: Policy,
    sampling: Sampling,
    max_turns: int,
    user: str,
    turns: list[Turn],
    max_model_len: int | None = None,
) -> EpisodeResult:
    """Run the loop. `turns` is filled as it goes, so a caller that times out still has the partial episode.

    The policy decides how tokens are made (chat completions, or token-in, token-out with `max_model_len` bounding
    the episode's context); the loop and the TokenTracker are the same for both."""
    state = EpisodeState.start(env, turns)
    schemas = [t.schema() for t in state.tools.values()]
    messages: list[dict[str, Any]] = env.messages(task)
    turns.extend(opening_turns(messages))
    tracker = TokenTracker()
    generation_s = tools_s = 0.0
    finish: Finish = "max_turns"
    model = ""
    episode_policy = policy.for_episode(max_model_len=max_model_len)
    for _ in range(max_turns):
        t0 = time.monotonic()
        try:
            c = await episode_policy.complete(messages, schemas, sampling, user=user)
        except ContextFull:
            finish = "length"  # the context is full: TRUNCATED, the tokens as far as they went
            break
        finally:
            generation_s += time.monotonic() - t0
        model = c.model
        tracker.add(c)
        messages.append(c.raw_message)
        calls = [ToolCallRecord(id=tc.id, name=tc.name, arguments=tc.arguments) for tc in c.tool_calls]
        record_assistant(state, c.text, calls)
        if not calls:
            state.answer = c.text
            finish = "length" if c.finish_reason == "length" else "stop"
            break
        t0 = time.monotonic()
        for call in calls:
            output = await run_tool_call(env, sandbox, state, call)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
            if state.submitted:
                break
        tools_s += time.monotonic() - t0
        if state.submitted:
            finish = "submit"
            break
    return EpisodeResult(state.episode(finish), tracker, generation_s, tools_s, model)
