"""The agent loop of one episode: policy call -> parse tool calls -> run them in the sandbox -> observation, until
submit, a stop, or a limit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from orchestrator.core.environment import Environment, Episode, Finish, Task
from orchestrator.core.errors import EnvironmentBroken, PolicyError, SandboxError
from orchestrator.core.models import ToolCallRecord, Turn
from orchestrator.core.policy import Sampling
from orchestrator.core.sandbox import Sandbox
from orchestrator.core.tools import Tool, call_tool
from orchestrator.rollout.policy.base import Policy
from orchestrator.rollout.tokens import TokenTracker

T = TypeVar("T")


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
    tools: list[Tool],
    sampling: Sampling,
    max_turns: int,
    user: str,
    turns: list[Turn],
) -> EpisodeResult:
    """Run the loop. `turns` is filled as it goes, so a caller that times out still has the partial episode."""
    by_name = {t.name: t for t in tools}
    schemas = [t.schema() for t in tools]
    messages: list[dict[str, Any]] = env.messages(task)
    turns.extend(Turn(role=m["role"], text=str(m.get("content") or "")) for m in messages)
    tracker = TokenTracker()
    generation_s = tools_s = 0.0
    answer: str | None = None
    finish: Finish = "max_turns"
    calls = 0
    model = ""
    for _ in range(max_turns):
        t0 = time.monotonic()
        c = await policy.complete(messages, schemas, sampling, user=user)
        generation_s += time.monotonic() - t0
        model = c.model
        tracker.add(c)
        messages.append(c.raw_message)
        turns.append(
            Turn(
                role="assistant",
                text=c.text,
                tool_calls=[ToolCallRecord(id=tc.id, name=tc.name, arguments=tc.arguments) for tc in c.tool_calls],
            )
        )
        if not c.tool_calls:
            answer = c.text
            finish = "length" if c.finish_reason == "length" else "stop"
            break
        submitted = False
        t0 = time.monotonic()
        for tc in c.tool_calls:
            calls += 1
            tool = by_name.get(tc.name)
            if tool is None:
                output = f"error: unknown tool {tc.name!r}; available: {', '.join(by_name)}"
            else:
                result = await call_tool(tool, sandbox, tc.arguments, env.tool_timeout_s)
                output = result.output
                if result.submitted:
                    submitted, answer = True, result.answer
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": output})
            turns.append(Turn(role="tool", text=output, tool_call_id=tc.id, name=tc.name))
            if submitted:
                break
        tools_s += time.monotonic() - t0
        if submitted:
            finish = "submit"
            break
    return EpisodeResult(Episode(turns, answer, finish, calls), tracker, generation_s, tools_s, model)


async def env_call(coro: Awaitable[T]) -> T:
    """Await environment code; its failures (other than sandbox and policy ones) mean the environment is broken."""
    try:
        return await coro
    except (SandboxError, PolicyError, asyncio.CancelledError, TimeoutError):
        raise
    except Exception as e:
        raise EnvironmentBroken(f"{type(e).__name__}: {e}") from e
