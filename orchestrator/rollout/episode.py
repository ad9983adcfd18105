"""The agent loop of one episode: policy call -> parse tool calls -> run them in the sandbox (the one step in
orchestrator/rollout/step.py) -> observation, until submit, a stop, or a limit."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.core.environment import Environment, Episode, Finish, Task
from orchestrator.core.errors import ContextFull, EnvironmentBroken, GenerationTooLong, PolicyError
from orchestrator.core.models import ToolCallRecord, Turn
from orchestrator.core.policy import Sampling
from orchestrator.core.sandbox import Sandbox
from orchestrator.core.tools import ToolResult
from orchestrator.core.tracing import (
    FINISH_REASON,
    INPUT_TOKENS,
    MODEL,
    NOOP_SPAN,
    OUTPUT_TOKENS,
    TOOL_ARGUMENTS,
    TOOL_ARGUMENTS_BYTES,
    TOOL_EXIT_CODE,
    TOOL_NAME,
    TOOL_TIMED_OUT,
    TURN,
    AttributeValue,
    Phase,
    Span,
)
from orchestrator.rollout.policy import http
from orchestrator.rollout.policy.base import Completion, Policy
from orchestrator.rollout.policy.parsing import CUT_OFF
from orchestrator.rollout.step import EpisodeState, record_assistant, record_opening, run_tool_call
from orchestrator.rollout.tito.reasoning import answer_text
from orchestrator.rollout.tokens import TokenTracker

TOOL_SLACK_S = 30.0  # past its timeout, what a tool call may take to be stopped and answered
# A tool call that would run past the episode's deadline gets the time left as its own timeout: envd kills the
# command, and everything it started, before it answers, so no process of the policy's runs on when the grader
# starts. Cancelled at the deadline instead, the command was killed only once envd noticed the cancel, and a process
# it had started could watch for the grader's and read its input (a code-tests case and its expected value) in that
# window. The episode's own timer, this much past the deadline (and no later than `cut_by`), is only the backstop.
CUT_STOP_S = 5.0
GENERATING_S = 5.0  # a policy's answer that sent bytes this recently is being generated (_PastDeadline)
CHECK_S = 1.0  # past the deadline, how often a silent answer is looked at again
_NO_LIMIT = contextlib.nullcontext()


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
    *,
    span: Span = NOOP_SPAN,
    tool_seconds: Callable[[float], None] | None = None,
    deadline: float | None = None,
    cut_by: float | None = None,
    waits: http.Waits | None = None,
) -> EpisodeResult:
    """Run the loop. `turns` is filled as it goes, so a caller that times out still has the partial episode.

    The policy decides how tokens are made (chat completions, or token-in, token-out with `max_model_len` bounding
    the episode's context); the loop and the TokenTracker are the same for both. Each policy call and each tool
    call is a child span of `span`; their seconds sum to generation_s and tools_s. `tool_seconds` is told each tool
    call's seconds (the tool-exec histogram). `deadline` (the event loop's clock) bounds the tool calls: one that
    reaches it (its commands stop there, CUT_STOP_S), or one it finds passed, ends the episode there, TRUNCATED
    ("time"). What the policy's commands take is the
    policy's to spend (each is its own choice, up to the tool's timeout), so a rollout whose time they spent is
    scored, never a masked TIMEOUT. A generation past it is cut only while it is seen streaming in (_PastDeadline),
    by `cut_by` at the latest whatever its failed attempts took: a hung inference server is no outcome of the
    policy's (its requests have their own timeout, and the rollout's stays TIMEOUT). `waits`: what the rollout may
    wait out of its policy server down or busy; what it waited moves `deadline` and `cut_by` on (the runner's own
    end moves with it, Waits.moved)."""
    waits = waits if waits is not None else http.Waits(math.inf)
    state = EpisodeState.start(env, turns)
    schemas = [t.schema() for t in state.tools.values()]
    try:  # environment code, as setup and scoring are: a bug in it is ENV_ERROR, never retried as infrastructure
        messages: list[dict[str, Any]] = env.messages(task)
        record_opening(state, messages)
    except Exception as e:
        raise EnvironmentBroken(f"the environment's opening messages failed: {type(e).__name__}: {e}") from e
    if not state.fits():  # the environment's doing: an empty episode scored TRUNCATED would be none of the policy's
        raise EnvironmentBroken("the environment's opening messages are over the episode's budget (EPISODE_BYTES)")
    tracker = TokenTracker()
    generation_s = tools_s = 0.0
    finish: Finish = "max_turns"
    model = ""
    episode_policy = policy.for_episode(max_model_len=max_model_len)
    for turn in range(max_turns):
        phase = Phase(span, "policy", {TURN: turn})
        cut = _PastDeadline(deadline, cut_by, waits)
        try:
            with phase:
                async with cut:
                    c = await episode_policy.complete(messages, schemas, sampling, user=user)
                phase.span.set(_policy_attributes(c))
        except TimeoutError:
            if not cut.expired():
                raise
            finish = "time"  # past the deadline, still generating: TRUNCATED without the turn
            break
        except GenerationTooLong:
            finish = "length"  # the policy's answer is longer than an episode keeps: TRUNCATED without it
            break
        except ContextFull as e:
            if turn == 0:
                # nothing the policy did filled it: the job's prompt, max_tokens or max_model_len do not fit the
                # model, and every rollout of the job would be an empty episode scored as if the policy had tried
                raise PolicyError(f"the task's first prompt does not fit the model's context: {e}") from None
            finish = "length"  # the context is full: TRUNCATED, the tokens as far as they went
            break
        finally:
            generation_s += phase.seconds
        model = c.model
        texts = (x for tc in c.tool_calls for x in (tc.arguments, tc.name, tc.id))
        if not state.fits(c.text, *texts, tokens=tracker.count_with(c), calls=len(c.tool_calls)):
            finish = "length"  # the episode is as long as it may be (EPISODE_BYTES): TRUNCATED without this turn
            break
        tracker.add(c)
        messages.append(c.raw_message)
        calls = [ToolCallRecord(id=tc.id, name=tc.name, arguments=tc.arguments) for tc in c.tool_calls]
        record_assistant(state, c.text, calls)
        if not calls:
            state.answer = answer_text(c.text)  # its reasoning is no answer (a server's reasoning parser's part)
            # the parsers let through only a turn the server ended (an unfinished one is retried, then POLICY_ERROR)
            finish = "length" if c.finish_reason in CUT_OFF else "stop"
            break
        for call in calls:
            limit = None
            timeout_s = env.tool_timeout_s
            if deadline is not None:
                left = deadline + waits.waited - asyncio.get_running_loop().time()
                if left <= 0:
                    finish = "time"
                    break
                # a call that ends by its own timeout before the deadline needs no timer of the episode's (µs each)
                if left < env.tool_timeout_s + TOOL_SLACK_S:
                    timeout_s = min(timeout_s, left)
                    end = math.inf if cut_by is None else cut_by + waits.waited
                    limit = asyncio.timeout_at(min(deadline + waits.waited + CUT_STOP_S, end))
            phase = Phase(span, "tool", _call_attributes(call, turn))
            try:
                async with limit or _NO_LIMIT:
                    with phase:
                        result = await run_tool_call(env, sandbox, state, call, timeout_s)
                        phase.span.set(_result_attributes(result))
            except TimeoutError:
                if limit is None or not limit.expired():
                    raise
                finish = "time"
                break
            finally:
                tools_s += phase.seconds
                if tool_seconds is not None:
                    # every call, the one cut at the deadline and the one that failed too: the slowest were left out
                    tool_seconds(phase.seconds)
            if (
                deadline is not None
                and not state.submitted
                and asyncio.get_running_loop().time() >= deadline + waits.waited
            ):
                finish = "time"  # it ran to the deadline (stopped there, or ended by itself just past it)
                break
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.output})
            if state.submitted or not state.fits(tokens=tracker.count()):
                break
        if finish == "time":
            break
        if state.submitted:
            finish = "submit"
            break
        if not state.fits(tokens=tracker.count()):
            finish = "length"  # its observations filled the budget (each is capped, core/tools.py)
            break
    return EpisodeResult(state.episode(finish), tracker, generation_s, tools_s, model)


class _PastDeadline:
    """Around a policy call: past the episode's deadline, the call is cut once its answer is seen streaming in (bytes
    within the last GENERATING_S), the policy's own length, as a tool call is cut there ("time"); never while its
    server is silent, which may be a hung server's doing, no outcome of the policy's (its idle timeout or the
    rollout's decides). The time its failed attempts and their pauses took moves the deadline on. Uncut, a policy
    that wrote on past the deadline, into the scoring's reserve and the rollout's end, made a losing rollout
    TIMEOUT, masked. A whole (not streamed) answer shows no progress until it is done."""

    def __init__(self, deadline: float | None, cut_by: float | None = None, waits: http.Waits | None = None) -> None:
        self._deadline = deadline
        self._cut_by = cut_by  # the latest it moves on to: before the rollout's own end (a TIMEOUT, masked)
        self._timeout = asyncio.timeout(None)
        self._waits = waits if waits is not None else http.Waits(math.inf)
        self._progress = http.Progress(waits=self._waits)
        self._token: contextvars.Token[http.Progress | None] | None = None
        self._check: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> _PastDeadline:
        await self._timeout.__aenter__()
        if self._deadline is not None:
            self._token = http.PROGRESS.set(self._progress)
            self._check = asyncio.get_running_loop().call_at(self._deadline, self._look)
        return self

    def _look(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        assert self._deadline is not None
        # the time failed attempts took, and a wait for the server down, is the server's, not the policy's
        due = self._deadline + self._waits.waited + self._progress.lost
        if self._cut_by is not None:
            due = min(due, self._cut_by + self._waits.waited)
        if now < due:
            self._check = loop.call_at(due, self._look)
        elif now - self._progress.last < GENERATING_S:
            self._timeout.reschedule(now)
        else:
            self._check = loop.call_later(CHECK_S, self._look)

    async def __aexit__(self, *exc: Any) -> None:
        if self._check is not None:
            self._check.cancel()
        if self._token is not None:
            http.PROGRESS.reset(self._token)
        await self._timeout.__aexit__(*exc)  # TimeoutError when it cut the call

    def expired(self) -> bool:
        """Whether this cut the call."""
        return self._timeout.expired()


def _policy_attributes(c: Completion) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {MODEL: c.model, FINISH_REASON: c.finish_reason}
    if c.prompt_ids is not None:
        out[INPUT_TOKENS] = len(c.prompt_ids)
    if c.completion_ids is not None:
        out[OUTPUT_TOKENS] = len(c.completion_ids)
    return out


def _call_attributes(call: ToolCallRecord, turn: int) -> dict[str, AttributeValue]:
    # the policy chose the name and the arguments: the tracer caps both (MAX_ATTRIBUTE_CHARS)
    return {
        TOOL_NAME: call.name,
        TOOL_ARGUMENTS: call.arguments,
        TOOL_ARGUMENTS_BYTES: len(call.arguments.encode(errors="replace")),
        TURN: turn,
    }


def _result_attributes(result: ToolResult) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {TOOL_TIMED_OUT: result.timed_out}
    if result.exit_code is not None:
        out[TOOL_EXIT_CODE] = result.exit_code
    return out
