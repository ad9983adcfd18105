"""One OpenEnv `Environment` per websocket: an envfleet session driven through the gRPC SessionService.

The caller's credentials come from the facade's router (`CALLER`, set for the connection's task before OpenEnv's
handler runs), so every Reset, Step and CloseSession carries the caller's own bearer token and the orchestrator
decides who may do what. OpenEnv closes the environment when the websocket ends, however it ends; that closes the
session and destroys its sandbox.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import json
import logging
from dataclasses import dataclass
from typing import Any

import grpc
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from orchestrator.client.convert import step_outcome
from orchestrator.core.errors import (
    SERVER_STATUS_KEY,
    EnvfleetError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    QuotaExceededError,
    UnauthenticatedError,
)
from orchestrator.openenv.models import EnvfleetAction, EnvfleetObservation, EnvfleetState, ResetOptions
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0
SCORED = ("OK", "TRUNCATED")

Metadata = tuple[tuple[str, str], ...]
# The call metadata (the caller's authorization header, if any) of the connection being served.
CALLER: contextvars.ContextVar[Metadata] = contextvars.ContextVar("envfleet_openenv_caller", default=())

_ERRORS: dict[grpc.StatusCode, type[EnvfleetError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QuotaExceededError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


class OrchestratorCallError(EnvfleetError, RuntimeError):
    """The orchestrator could not be reached, or failed the call, for a reason that is not the caller's."""


# codes gRPC's own transport gives, whose details name this host's insides (the orchestrator's socket path, its
# addresses): a caller of the facade, before its token is checked, gets a fixed message; the log has the details
_TRANSPORT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DATA_LOSS,
}


def rpc_message(e: grpc.aio.AioRpcError) -> str:
    """A failed call's message for the facade's caller: "<STATUS>: <details>", the details only where they are the
    orchestrator's answer to the caller (SERVER_STATUS_KEY), not the transport's."""
    code = e.code()
    if code in _TRANSPORT_CODES and (SERVER_STATUS_KEY, "1") not in tuple(e.trailing_metadata() or ()):
        log.warning("a call to the orchestrator failed: %s: %s", code.name, e.details())
        return f"{code.name}: the orchestrator did not answer; the facade's log has the details"
    return f"{code.name}: {e.details() or 'no details'}"


def error_from_rpc(e: grpc.aio.AioRpcError) -> EnvfleetError:
    """The envfleet error of a failed call; its message (an OpenEnv error frame's) starts with the status name."""
    return _ERRORS.get(e.code(), OrchestratorCallError)(rpc_message(e))


@dataclass
class EnvInfo:
    """What the orchestrator last said about the environment (refreshed on every request that reaches it)."""

    ref: str
    name: str = ""
    version: str = ""
    description: str = ""


@dataclass(frozen=True)
class Backend:
    """The orchestrator's SessionService and the deadline of one call."""

    stub: pb_grpc.SessionServiceStub
    call_timeout_s: float


def _tool_schema(t: pb.ToolInfo) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters_json)},
    }


class EnvfleetEnvironment(Environment):  # type: ignore[type-arg]
    """An envfleet environment as an OpenEnv Environment: reset opens a session, step applies one action, close (the
    websocket's end) destroys the sandbox. Async only: OpenEnv awaits `reset_async` and `step_async`."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each instance is its own session and sandbox

    def __init__(self, backend: Backend, info: EnvInfo) -> None:
        super().__init__()
        self._backend = backend
        self._info = info
        self._session_id: str | None = None
        self._metadata: Metadata = ()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = EnvfleetState(env=info.ref)
        self._closing: set[asyncio.Task[None]] = set()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EnvfleetObservation:
        """Not served: episodes run over the websocket (`reset_async`)."""
        raise FailedPreconditionError("envfleet episodes run over the /ws session protocol")

    def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> EnvfleetObservation:
        """Not served: episodes run over the websocket (`step_async`)."""
        raise FailedPreconditionError("envfleet episodes run over the /ws session protocol")

    @property
    def state(self) -> EnvfleetState:
        """The session as of the last reset or step (no call: OpenEnv reads it on the event loop)."""
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        """The environment's name, version and description, as the orchestrator describes it."""
        name = f"{self._info.name}@{self._info.version}" if self._info.name else self._info.ref
        return EnvironmentMetadata(name=name, description=self._info.description, version=self._info.version)

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self._backend.call_timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from None

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> EnvfleetObservation:
        """A new episode: the previous session (if any) is closed, then a new one opened on the task asked for."""
        options = ResetOptions.model_validate({"seed": seed, "episode_id": episode_id, **kwargs})
        self._loop = asyncio.get_running_loop()
        self._metadata = CALLER.get()
        await self._close_session()
        req = pb.ResetRequest(env=self._info.ref, task_id=options.task_id, max_turns=options.max_turns)
        if options.seed is not None:
            req.seed = options.seed
        r = await self._call(self._backend.stub.Reset, req)
        self._session_id = r.session_id
        info = r.info
        self._state = EnvfleetState(
            episode_id=r.session_id, step_count=0, env=info.env, task_id=info.task_id, max_turns=info.max_turns
        )
        return EnvfleetObservation(
            text=r.observation.text,
            reward=None,
            done=False,
            metadata={
                "session_id": r.session_id,
                "env": info.env,
                "task_id": info.task_id,
                "seed": info.seed,
                "max_turns": info.max_turns,
                "turn": info.turn,
                "messages": [{"role": m.role, "content": m.text} for m in r.observation.messages],
                "tools": [_tool_schema(t) for t in r.observation.tools],
            },
        )

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> EnvfleetObservation:
        """Apply one action; the last step carries the score (or, for a failure, no reward) and `done`."""
        if self._session_id is None:
            raise FailedPreconditionError("no episode is running: send a reset first")
        if not isinstance(action, EnvfleetAction):  # OpenEnv's MCP action types reach step too
            raise InvalidRequestError("give a tool call ('name' and 'arguments') or a final answer ('answer')")
        if action.name is not None:
            call = pb.ToolCall(id=action.id, name=action.name, arguments=action.arguments_json())
            act = pb.Action(tool_call=call)
        else:
            act = pb.Action(final_answer=action.answer or "")
        r = await self._call(self._backend.stub.Step, pb.StepRequest(session_id=self._session_id, action=act))
        outcome = step_outcome(r)  # a status newer than this client: not scored
        status = outcome.status.value if outcome.status is not None else ""  # the models' short name ("OK")
        done = bool(status) or r.terminated or r.truncated
        metadata: dict[str, Any] = {"turn": r.info.turn, "terminated": r.terminated, "truncated": r.truncated}
        if status:
            metadata |= {
                "status": status,
                "scored": status in SCORED,
                "reward_components": dict(r.reward_components),
                "metrics": dict(r.metrics),
            }
            if outcome.error_kind or outcome.error_message:
                metadata["error"] = {"kind": outcome.error_kind, "message": outcome.error_message}
        self._state = self._state.model_copy(update={"step_count": r.info.turn, "done": done, "status": status})
        # an episode that failed for a reason that is not the policy's has no reward: None, never 0
        reward = outcome.reward
        return EnvfleetObservation(text=r.observation, reward=reward, done=done, metadata=metadata)

    async def _close_session(self) -> None:
        sid, self._session_id = self._session_id, None
        if sid is None:
            return
        try:
            await self._call(self._backend.stub.CloseSession, pb.CloseSessionRequest(session_id=sid))
        except NotFoundError:
            pass  # it expired already: nothing holds a sandbox
        except EnvfleetError as e:  # the orchestrator's idle TTL destroys the sandbox in the end
            log.warning("could not close session %s: %s", sid, e)

    def close(self) -> None:
        """Close the session (OpenEnv calls this from a worker thread when the websocket ends)."""
        loop = self._loop
        if self._session_id is None or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:  # called on the loop itself (OpenEnv's fallback): close without blocking it
            task = loop.create_task(self._close_session())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            return
        future = asyncio.run_coroutine_threadsafe(self._close_session(), loop)
        try:
            future.result(CLOSE_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError) as e:
            log.warning("closing the session of an OpenEnv connection failed: %r", e)
