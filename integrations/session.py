"""SessionService for trainer adapters: typed openings and step results, one tool call or answer per step.

The verl agent loop (async) and the SkyRL environment (sync) drive episodes through these; both see the same types:

    sessions = AsyncSessions(client)                       # an EnvfleetClient
    opening = await sessions.reset("python-tool", task_id="py-000")
    result = await sessions.step(opening.session_id, ToolCall("call_0", "python", '{"code": "print(1)"}'))
    await sessions.close(opening.session_id)

A step's `reward` is None until the episode ends, and stays None when it failed for a reason that is not the
policy's (`scored` is False): an adapter masks that sample, it never trains on a 0.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from orchestrator.client.auth import ClientTLS, bearer_metadata, sync_channel
from orchestrator.client.busy import BUSY_WAIT_S, retry_busy, retry_busy_sync
from orchestrator.client.convert import step_outcome
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.client.step_retry import send_step, send_step_async, step_request, turn_of
from orchestrator.core.errors import EpisodeFailedError
from orchestrator.core.models import RolloutStatus
from orchestrator.core.text import as_text
from orchestrator.rollout.policy.base import ToolCall
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Message = dict[str, Any]


@dataclass(frozen=True)
class Opening:
    """A session's start: its id, the opening chat messages and the tools (OpenAI schemas) the policy may call."""

    session_id: str
    env: str
    task_id: str
    max_turns: int
    messages: list[Message]
    tools: list[dict[str, Any]]


@dataclass(frozen=True)
class StepResult:
    """What one action did. `status` and `reward` are set on the last step only; reward None = nothing to learn."""

    observation: str
    reward: float | None
    terminated: bool
    truncated: bool
    status: RolloutStatus | None
    reward_components: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    error_kind: str = ""
    error_message: str = ""

    @property
    def done(self) -> bool:
        """The episode is over (answered, out of turns, or failed)."""
        return self.terminated or self.truncated

    @property
    def scored(self) -> bool:
        """The episode ended with a reward to learn from (OK or TRUNCATED)."""
        return self.status is not None and self.status.scored

    def failure(self) -> EpisodeFailedError:
        """The error for an episode that ended unscored."""
        status = self.status.value if self.status is not None else "UNSPECIFIED"
        return EpisodeFailedError(status, self.error_kind, self.error_message)


# a Step's statuses that are the fleet's failing, not the request's
FLEET_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED})


def _raise_fleet_failure(e: grpc.RpcError) -> None:
    """EpisodeFailedError INFRA_ERROR for a Step the fleet failed (the server gone, the session expired or lost with
    a restart, no answer in time), which run_episode retries on a fresh session; a bare gRPC error failed the
    trainer's whole generation batch. Another status is left to its caller to raise."""
    if e.code() in FLEET_FAILURES:
        raise EpisodeFailedError("INFRA_ERROR", e.code().name, e.details() or "") from e


def _unclosed(session_id: str, e: grpc.RpcError) -> None:
    # gone already (expired, a restart), or the server is: its idle expiry releases the sandbox. Raised, it took the
    # place of the episode's own error (an INFRA_ERROR to retry) in run_episode's cleanup
    if e.code() != grpc.StatusCode.NOT_FOUND:
        log.warning("could not close session %s (%s): its idle expiry releases it", session_id, e.code().name)


def reset_request(env: str, task_id: str = "", seed: int | None = None, max_turns: int = 0) -> pb.ResetRequest:
    """A Reset on a task id, else on a task drawn with the seed."""
    req = pb.ResetRequest(env=env, task_id=task_id, max_turns=max_turns)
    if not task_id and seed is not None:
        req.seed = seed
    return req


def opening_from_pb(r: pb.ResetResponse) -> Opening:
    """The wire's ResetResponse as an Opening."""
    return Opening(
        session_id=r.session_id,
        env=r.info.env,
        task_id=r.info.task_id,
        max_turns=r.info.max_turns,
        messages=[{"role": m.role, "content": m.text} for m in r.observation.messages],
        tools=[
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters_json)},
            }
            for t in r.observation.tools
        ],
    )


def action_pb(action: ToolCall | str) -> pb.Action:
    """A tool call, or (a str) the final answer. Each string made text (as_text): a policy's `\\ud800` escape
    decodes to a lone surrogate, which protobuf refuses (UTF-8 has none), and it raised out of the episode."""
    if isinstance(action, str):
        return pb.Action(final_answer=as_text(action))
    call = pb.ToolCall(id=as_text(action.id), name=as_text(action.name), arguments=as_text(action.arguments))
    return pb.Action(tool_call=call)


def step_from_pb(r: pb.StepResponse) -> StepResult:
    """The wire's StepResponse as a StepResult (status by its short name, reward None when absent)."""
    outcome = step_outcome(r)
    return StepResult(
        observation=r.observation,
        reward=outcome.reward,
        terminated=r.terminated,
        truncated=r.truncated,
        status=outcome.status,
        reward_components=dict(r.reward_components),
        metrics=dict(r.metrics),
        error_kind=outcome.error_kind,
        error_message=outcome.error_message,
    )


# Step's deadline: None, the server's own bound (the tool call, then a final step's grading, up to the grader's own
# timeouts, past 300 s for some); a server that stops answering is found by keepalive. Shorter, a final step cut
# here was scored by the server all the same, its reward lost, and the episode's close destroyed the sandbox
STEP_TIMEOUT_S: float | None = None


class _Turns:
    """Each open session's turn, as its last answer said (a Step whose answer is lost is sent again at it,
    step_retry); forgotten when the episode ends or the session closes."""

    def __init__(self) -> None:
        self._turns: dict[str, int] = {}

    def opened(self, r: pb.ResetResponse) -> Opening:
        if (turn := turn_of(r.info)) is not None:
            self._turns[r.session_id] = turn
        return opening_from_pb(r)

    def request(self, session_id: str, action: ToolCall | str) -> pb.StepRequest:
        return step_request(session_id, action_pb(action), self._turns.get(session_id))

    def answered(self, session_id: str, r: pb.StepResponse) -> StepResult:
        result = step_from_pb(r)
        if result.done or (turn := turn_of(r.info)) is None:
            self._turns.pop(session_id, None)
        else:
            self._turns[session_id] = turn
        return result

    def closed(self, session_id: str) -> None:
        self._turns.pop(session_id, None)


class AsyncSessions:
    """SessionService over an EnvfleetClient's channel (its token and TLS), for asyncio code. `timeout_s` is Reset's
    and Close's deadline; `step_timeout_s` Step's (STEP_TIMEOUT_S); `busy_wait_s` how long Reset asks again while
    the server is busy (the host full, the tenant's sessions at their cap: orchestrator/client/busy.py), 0 not at
    all."""

    def __init__(
        self,
        client: EnvfleetClient,
        *,
        timeout_s: float = 300.0,
        step_timeout_s: float | None = STEP_TIMEOUT_S,
        busy_wait_s: float = BUSY_WAIT_S,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.busy_wait_s = busy_wait_s
        self._turns = _Turns()

    async def reset(self, env: str, task_id: str = "", *, seed: int | None = None, max_turns: int = 0) -> Opening:
        """Acquire a sandbox and set the task up."""
        reset = functools.partial(self.client.session_stub.Reset, reset_request(env, task_id, seed, max_turns))
        return self._turns.opened(await retry_busy(functools.partial(reset, timeout=self.timeout_s), self.busy_wait_s))

    async def step(self, session_id: str, action: ToolCall | str) -> StepResult:
        """Run one tool call, or give the final answer; sent again at its turn while its answer is lost
        (step_retry), then the fleet failing it is EpisodeFailedError INFRA_ERROR."""
        call = functools.partial(self.client.session_stub.Step, timeout=self.step_timeout_s)
        try:
            r = await send_step_async(call, self._turns.request(session_id, action))
        except grpc.aio.AioRpcError as e:
            _raise_fleet_failure(e)
            raise
        return self._turns.answered(session_id, r)

    async def close(self, session_id: str) -> None:
        """Release the sandbox; a session that already expired has nothing to release."""
        self._turns.closed(session_id)
        try:
            await self.client.session_stub.CloseSession(
                pb.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() not in FLEET_FAILURES:
                raise
            _unclosed(session_id, e)


class SyncSessions:
    """SessionService on a blocking channel of its own, for code without asyncio (SkyRL runs env.step in threads).
    `timeout_s`, `step_timeout_s` and `busy_wait_s` as in AsyncSessions."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: ClientTLS | None = None,
        insecure: bool = False,
        timeout_s: float = 300.0,
        step_timeout_s: float | None = STEP_TIMEOUT_S,
        busy_wait_s: float = BUSY_WAIT_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.busy_wait_s = busy_wait_s
        self._metadata = bearer_metadata(token)
        self._channel = sync_channel(target, token=token, tls=tls, insecure=insecure)
        self._stub = pb_grpc.SessionServiceStub(self._channel)
        self._turns = _Turns()  # SkyRL steps its environments in threads: each session's entry is its own

    def reset(self, env: str, task_id: str = "", *, seed: int | None = None, max_turns: int = 0) -> Opening:
        """Acquire a sandbox and set the task up."""
        req = reset_request(env, task_id, seed, max_turns)
        reset = functools.partial(self._stub.Reset, req, timeout=self.timeout_s, metadata=self._metadata)
        return self._turns.opened(retry_busy_sync(reset, self.busy_wait_s))

    def step(self, session_id: str, action: ToolCall | str) -> StepResult:
        """Run one tool call, or give the final answer; sent again at its turn while its answer is lost
        (step_retry), then the fleet failing it is EpisodeFailedError INFRA_ERROR."""
        call = functools.partial(self._stub.Step, timeout=self.step_timeout_s, metadata=self._metadata)
        try:
            r = send_step(call, self._turns.request(session_id, action))
        except grpc.RpcError as e:
            _raise_fleet_failure(e)
            raise
        return self._turns.answered(session_id, r)

    def close(self, session_id: str) -> None:
        """Release the sandbox; a session that already expired has nothing to release."""
        self._turns.closed(session_id)
        try:
            self._stub.CloseSession(
                pb.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            if e.code() not in FLEET_FAILURES:
                raise
            _unclosed(session_id, e)

    def shutdown(self) -> None:
        """Close the channel."""
        self._channel.close()
