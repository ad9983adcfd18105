"""One episode step and one outcome classification, used by every entry point: the agent loop (jobs), sessions,
the environment checker and registration validation.

A step records the assistant's tool calls, runs each in the sandbox and records its observation. Task-level
problems (an unknown tool, bad arguments, a tool timeout) are observations for the policy. Everything else ends the
episode and is classified once, by `classify_failure`: an infrastructure failure is never a reward.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any, TypeVar

from orchestrator.core.echo import echo
from orchestrator.core.environment import Environment, Episode, Finish, Score, Task
from orchestrator.core.errors import ConfigError, EnvironmentBroken, PolicyError, SandboxError
from orchestrator.core.models import RolloutError, RolloutStatus, ToolCallRecord, Turn
from orchestrator.core.sandbox import Sandbox
from orchestrator.core.tools import Tool, ToolResult, call_tool, get_tools

log = logging.getLogger(__name__)
T = TypeVar("T")

# What one episode may keep: the text of its turns (the policy's or a session's, and the tools' observations) and
# its tokens, counted as the result log's JSON holds them. Whoever writes the turns writes as much as they are let
# (a policy's answer up to 32 MiB and max_turns up to 1000; a session's action up to 4 Mi characters): past this an
# episode ends TRUNCATED, as at a full context, and the turn that would cross it is not kept. It is the writer's
# outcome, scored, never a masked failure: an encoded rollout over 16 MiB (worker/results.MAX_ROLLOUT_BYTES) is
# refused as an infrastructure failure, so the budget keeps well under that.
EPISODE_BYTES = 8 << 20
TURN_BYTES = 96  # a turn's JSON around its texts (its keys, role, quotes), counted high
CALL_BYTES = 64  # a tool call's
TOKEN_BYTES = 40  # a token's id, mask and logprob as JSON, at most
MAX_UNKNOWN_NAME = 256  # what an unknown tool's observation keeps of its name


@dataclass
class EpisodeState:
    """An episode as it runs: its turns, the tools it may call, and, once it ended, how."""

    tools: dict[str, Tool]
    turns: list[Turn] = field(default_factory=list)
    tool_calls: int = 0
    answer: str | None = None
    submitted: bool = False
    # the bytes of its turns' text (EPISODE_BYTES); while `exact` is False, a bound of them: each character is at
    # most six bytes of JSON, and counting exactly costs more than the rest of a light turn's bookkeeping, so it is
    # done only once the bound nears the budget
    kept: int = 0
    exact: bool = False

    @classmethod
    def start(cls, env: Environment, turns: list[Turn] | None = None) -> EpisodeState:
        """A fresh episode with the environment's tools; `turns` (kept by reference) receives every turn."""
        return cls({t.name: t for t in get_tools(env.tools)}, turns if turns is not None else [])

    def episode(self, finish: Finish) -> Episode:
        """The episode as the scorer sees it."""
        return Episode(list(self.turns), self.answer, finish, self.tool_calls)

    def fits(self, *texts: str, tokens: int = 0, calls: int = 0) -> bool:
        """Whether the episode stays within EPISODE_BYTES with `texts` more in a turn of `calls` tool calls (their
        names and ids among the texts), and `tokens` tokens in all."""
        room = EPISODE_BYTES - tokens * TOKEN_BYTES - TURN_BYTES - calls * CALL_BYTES
        if not self.exact:
            bound = self.kept
            for t in texts:
                bound += 6 * len(t) + 2
            if bound <= room:
                return True
            self.kept, self.exact = sum(map(_turn_bytes, self.turns)), True
        return self.kept + sum(map(json_bytes, texts)) <= room

    def _keep(self, turn: Turn) -> None:
        self.turns.append(turn)
        if self.exact:
            self.kept += _turn_bytes(turn)
        else:
            self.kept += TURN_BYTES + 6 * (len(turn.text) + len(turn.name) + len(turn.tool_call_id)) + 6
            for call in turn.tool_calls or ():
                self.kept += CALL_BYTES + 6 * (len(call.arguments) + len(call.name) + len(call.id)) + 6


def _turn_bytes(turn: Turn) -> int:
    """A turn's bytes in the rollout's JSON: its texts, a tool call's name and id among them (junk names and 2,000
    calls a turn took a rollout within the budget to 19-27 MiB, over what a worker may send: a scored rollout was an
    INFRA_ERROR, masked, on workers alone), and the structure around them."""
    own = TURN_BYTES + json_bytes(turn.text) + json_bytes(turn.name) + json_bytes(turn.tool_call_id)
    return own + sum(
        CALL_BYTES + json_bytes(c.arguments) + json_bytes(c.name) + json_bytes(c.id) for c in turn.tool_calls or ()
    )


def json_bytes(text: str) -> int:
    """The bytes of `text` as a JSON string: a control character is six there."""
    # the C escaper json.dumps uses, without the encoder it would make at every call (half the time)
    return len(encode_basestring(text).encode(errors="replace"))


def opening_turns(messages: Sequence[dict[str, Any]]) -> list[Turn]:
    """The opening chat messages of an episode (Environment.messages) as the turns a rollout records."""
    return [Turn(role=m["role"], text=str(m.get("content") or "")) for m in messages]


def record_opening(state: EpisodeState, messages: Sequence[dict[str, Any]]) -> None:
    """Record the opening chat messages as the episode's first turns, counted in its budget as every turn is (the
    environment's prompt, left out, let the cheap bound pass an episode over EPISODE_BYTES by its size)."""
    record_turns(state, opening_turns(messages))


def record_turns(state: EpisodeState, turns: Sequence[Turn]) -> None:
    """Record turns made already (a session's opening, made for its Reset's observation)."""
    for turn in turns:
        state._keep(turn)


def record_assistant(state: EpisodeState, text: str, calls: Sequence[ToolCallRecord]) -> None:
    """Record one assistant turn with the tool calls it made."""
    state._keep(Turn(role="assistant", text=text, tool_calls=list(calls)))


async def run_tool_call(
    env: Environment, sandbox: Sandbox, state: EpisodeState, call: ToolCallRecord, timeout_s: float | None = None
) -> ToolResult:
    """Run one tool call in the sandbox and record its observation; returns the result (`output` is the observation).
    Its commands stop at `timeout_s` (default: the environment's tool_timeout_s).

    A `submit` sets the state's answer. SandboxError propagates: the sandbox failed, not the policy.
    """
    state.tool_calls += 1
    tool = state.tools.get(call.name)
    if not call.name:
        result = ToolResult(
            f"error: the tool call names no tool (it could not be read); available: {', '.join(state.tools)}"
        )
    elif tool is None:
        # the name is echoed cut and kept cut: the assistant's turn holds it whole already (a name of megabytes,
        # quoted and kept again, took the rollout past what the result log stores)
        result = ToolResult(f"error: unknown tool {echo(call.name)}; available: {', '.join(state.tools)}")
        state._keep(Turn(role="tool", text=result.output, tool_call_id=call.id, name=call.name[:MAX_UNKNOWN_NAME]))
        return result
    else:
        result = await call_tool(tool, sandbox, call.arguments, env.tool_timeout_s if timeout_s is None else timeout_s)
        if result.submitted:
            state.submitted, state.answer = True, result.answer
    state._keep(Turn(role="tool", text=result.output, tool_call_id=call.id, name=call.name))
    return result


async def replay_reference(env: Environment, sandbox: Sandbox, task: Task) -> Episode:
    """Run a task's reference tool calls as a policy would (one assistant turn per call), until `submit`."""
    state = EpisodeState.start(env, [Turn(role="user", text=task.prompt)])
    for i, inv in enumerate(task.reference):
        call = ToolCallRecord(id=f"ref-{i}", name=inv.name, arguments=json.dumps(dict(inv.arguments)))
        record_assistant(state, "", [call])
        await run_tool_call(env, sandbox, state, call)
        if state.submitted:
            return state.episode("submit")
    return state.episode("stop")


async def env_call(coro: Awaitable[T]) -> T:
    """Await environment code (setup, scoring); its failures, other than sandbox and policy ones, mean the
    environment is broken (ENV_ERROR). A TimeoutError from inside is the environment's own (an asyncio.wait_for
    of its code's): the rollout's deadline cancels this call and becomes a TimeoutError outside it."""
    try:
        return await coro
    except (SandboxError, PolicyError, asyncio.CancelledError):
        raise
    except Exception as e:
        raise EnvironmentBroken(f"{type(e).__name__}: {e}") from e


async def env_score(env: Environment, sandbox: Sandbox, task: Task, episode: Episode) -> Score:
    """`env.score(...)` as env_call awaits it, and a Score: anything else (a number returned instead) is the
    environment's failure, ENV_ERROR, not an unclassified one (INFRA_ERROR, retried as the fleet's)."""
    score = await env_call(env.score(sandbox, task, episode))
    if not isinstance(score, Score):
        raise EnvironmentBroken(f"{env.ref()}.score returned a {type(score).__name__}, not a Score")
    return score


def finished_status(finish: Finish) -> RolloutStatus:
    """The status of an episode that ended normally: a turn, size or time limit is TRUNCATED, the rest OK."""
    return RolloutStatus.TRUNCATED if finish in ("max_turns", "length", "time") else RolloutStatus.OK


def classify_failure(
    e: BaseException, *, timeout_message: str = "the episode exceeded its time limit"
) -> tuple[RolloutStatus, RolloutError]:
    """The one classification of an episode that failed: which status, and the error the trainer sees.

    The order matters: PolicyTimeoutError is a policy failure and SandboxStartTimeoutError an infrastructure one,
    though both are TimeoutErrors. A failure nobody classified is infrastructure: never a reward, never lost.
    """
    status: RolloutStatus
    if isinstance(e, PolicyError):
        status = RolloutStatus.POLICY_ERROR
    elif isinstance(e, SandboxError | ConfigError):  # ConfigError: this host lacks what the fleet promised
        status = RolloutStatus.INFRA_ERROR
    elif isinstance(e, EnvironmentBroken):
        status = RolloutStatus.ENV_ERROR
        e = e.__cause__ or e
        _log_environment_bug(e)
    elif isinstance(e, TimeoutError):
        status = RolloutStatus.TIMEOUT
        if not str(e):
            e = TimeoutError(timeout_message)
    else:
        log.error("unclassified failure, counted as infrastructure", exc_info=e)
        status = RolloutStatus.INFRA_ERROR
    notes = "; ".join(str(n) for n in getattr(e, "__notes__", ()))  # where it was raised ("in reward function 'x'")
    message = str(e) or repr(e)
    return status, RolloutError(kind=type(e).__name__, message=f"{message} ({notes})" if notes else message)


_BUGS_LOGGED: dict[tuple[str, str, int], tuple[float, set[str]]] = {}  # place -> since when, the messages logged
MAX_BUG_PLACES = 256  # places an environment's failure was raised at; past them no new one is logged
MAX_BUGS_PER_PLACE = 5  # messages logged for one place (one tenant's grader failures did not hide another's)
BUG_MEMORY_S = 3600.0  # then a place logs again: a fleet's first hour did not silence its next weeks


def _log_environment_bug(e: BaseException) -> None:
    """An environment's own failure, with its traceback, once per place it was raised and message it said, a few
    messages a place an hour: the trainer sees its type and message only, and its author needs the line (one
    rollout's, not every rollout's of a broken environment; a few messages, or one tenant's grader failure hid every
    other's raised at the same line, and one whose message names each task filled the log)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return
    where = (type(e).__name__, tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    now = time.monotonic()
    entry = _BUGS_LOGGED.get(where)
    if entry is None or now - entry[0] >= BUG_MEMORY_S:
        for place in [p for p, (when, _) in _BUGS_LOGGED.items() if now - when >= BUG_MEMORY_S]:
            del _BUGS_LOGGED[place]
        if len(_BUGS_LOGGED) >= MAX_BUG_PLACES:
            return
        entry = _BUGS_LOGGED[where] = (now, set())
    said = entry[1]
    message = str(e)[:200]
    if message in said or len(said) >= MAX_BUGS_PER_PLACE:
        return
    said.add(message)
    log.warning("an environment failed (ENV_ERROR; logged once for this place and message)", exc_info=e)
