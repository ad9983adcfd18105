"""Sessions and raw sandboxes <-> protobuf, at the edge."""

from __future__ import annotations

import json

from orchestrator.client.convert import ROLLOUT_STATUS_PB
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.models import Turn
from orchestrator.core.sandbox import Command, ExecEnded, ExecEvent, ExecOutput, ExecStarted, Limits
from orchestrator.core.tools import Tool
from orchestrator.service.sandboxes import SandboxRecord
from orchestrator.service.sessions import Action, FinalAnswer, Observation, SessionView, StepResult, ToolAction
from protos import orchestrator_pb2 as pb

MAX_ID = 128
MAX_ACTION_BYTES = 4 << 20
# a StepRequest's largest: an action's text at MAX_ACTION_BYTES characters of up to 4 bytes each, and its other fields
MAX_STEP_REQUEST_BYTES = 4 * MAX_ACTION_BYTES + (64 << 10)

_SANDBOX_STATE_PB = {
    "RUNNING": pb.SANDBOX_STATE_RUNNING,
    "EXPIRED": pb.SANDBOX_STATE_EXPIRED,
    "DELETED": pb.SANDBOX_STATE_DELETED,
    "DIED": pb.SANDBOX_STATE_DIED,
}


def check_id(value: str, what: str) -> str:
    """A non-empty id of sane length."""
    if not value:
        raise InvalidRequestError(f"{what} is empty")
    if len(value) > MAX_ID:
        raise InvalidRequestError(f"{what} is too long (over {MAX_ID} characters)")
    return value


def action_from_pb(m: pb.Action) -> Action:
    """A tool call or a final answer; INVALID_ARGUMENT when neither is given."""
    which = m.WhichOneof("kind")
    if which == "tool_call":
        c = m.tool_call
        # a name is the policy's text as a parser read it (empty: an unclosed <tool_call>; any length: whatever the
        # model wrote): like an unknown tool, an error the policy is told in the step's observation, as a job's
        # rollout tells it; refused here (an empty one, then one over 128 characters), the policy's own output
        # failed the adapter's whole batch. It is bounded as the arguments are
        if len(c.name) > MAX_ACTION_BYTES:
            raise InvalidRequestError(f"action.tool_call.name is over {MAX_ACTION_BYTES} characters")
        if len(c.arguments) > MAX_ACTION_BYTES:
            raise InvalidRequestError(f"action.tool_call.arguments is over {MAX_ACTION_BYTES} characters")
        if len(c.id) > MAX_ID:
            raise InvalidRequestError(f"action.tool_call.id is over {MAX_ID} characters")
        return ToolAction(c.name, c.arguments, c.id)
    if which == "final_answer":
        if len(m.final_answer) > MAX_ACTION_BYTES:
            raise InvalidRequestError(f"action.final_answer is over {MAX_ACTION_BYTES} characters")
        return FinalAnswer(m.final_answer)
    raise InvalidRequestError("action is empty: give a tool_call or a final_answer")


def tool_info_pb(t: Tool) -> pb.ToolInfo:
    """A tool's name, description and JSON schema."""
    return pb.ToolInfo(name=t.name, description=t.description, parameters_json=json.dumps(t.parameters))


def turn_pb(t: Turn) -> pb.Turn:
    """One chat message."""
    return pb.Turn(
        role=t.role,
        text=t.text,
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in t.tool_calls],
        tool_call_id=t.tool_call_id,
        name=t.name,
    )


def session_info_pb(v: SessionView) -> pb.SessionInfo:
    """A session's public state."""
    return pb.SessionInfo(
        env=v.env,
        task_id=v.task_id,
        seed=v.seed,
        turn=v.turn,
        max_turns=v.max_turns,
        image=v.image,
        idle_ttl_s=v.idle_ttl_s,
        steps_by_turn=True,
    )


def reset_response_pb(view: SessionView, obs: Observation) -> pb.ResetResponse:
    """Reset's answer."""
    return pb.ResetResponse(
        session_id=view.session_id,
        observation=pb.Observation(
            text=obs.text, messages=[turn_pb(t) for t in obs.messages], tools=[tool_info_pb(t) for t in obs.tools]
        ),
        info=session_info_pb(view),
    )


def step_response_pb(r: StepResult) -> pb.StepResponse:
    """Step's answer."""
    m = pb.StepResponse(
        observation=r.observation,
        terminated=r.terminated,
        truncated=r.truncated,
        status=ROLLOUT_STATUS_PB[r.status.value] if r.status is not None else pb.ROLLOUT_STATUS_UNSPECIFIED,
        reward_components=r.components,
        metrics=r.metrics,
        info=session_info_pb(r.info),
    )
    if r.reward is not None:
        m.reward = r.reward
    if r.error is not None:
        m.error.kind, m.error.message = r.error.kind, r.error.message
    return m


def limits_pb(lim: Limits) -> pb.SandboxLimits:
    """Limits as applied."""
    return pb.SandboxLimits(**lim.model_dump())


def sandbox_info_pb(r: SandboxRecord) -> pb.SandboxInfo:
    """A raw sandbox's state."""
    return pb.SandboxInfo(
        sandbox_id=r.sandbox_id,
        image=r.image,
        env=r.env,
        state=_SANDBOX_STATE_PB[r.state],
        state_name=r.state,
        limits=limits_pb(r.limits),
        created_at=r.created_at,
        expires_at=r.expires_at,
        ended_at=r.ended_at,
        end_reason=r.end_reason,
        runtime=r.runtime,
    )


def command_from_pb(m: pb.ExecRequest) -> Command:
    """The command of an Exec: a shell string or an argv list."""
    which = m.WhichOneof("command")
    if which == "shell":
        return m.shell
    if which == "argv":
        return list(m.argv.args)
    raise InvalidRequestError("command is empty: give shell or argv")


def exec_event_pb(ev: ExecEvent) -> pb.ExecEvent:
    """One streamed exec event."""
    if isinstance(ev, ExecStarted):
        return pb.ExecEvent(started=pb.ExecStarted(pid=ev.pid))
    if isinstance(ev, ExecOutput):
        return pb.ExecEvent(stdout=ev.data) if ev.stream == "stdout" else pb.ExecEvent(stderr=ev.data)
    assert isinstance(ev, ExecEnded)
    return pb.ExecEvent(
        ended=pb.ExecEnded(
            exit_code=ev.exit_code,
            signal=ev.signal,
            timed_out=ev.timed_out,
            truncated=ev.truncated,
            oom_killed=ev.oom_killed,
            duration_s=ev.duration_s,
        )
    )
