"""A session's Step sent again when its answer is lost: safe, since it names the turn it was taken at.

The server answers a Step at a turn it has taken already with that step's answer, without acting again
(StepRequest.turn): a final step's reward survives a dropped connection, and a tool call never runs twice. Without
this, a lost answer failed the episode (INFRA_ERROR), and an adapter ran it again on a new session, its scored first
run thrown away."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from protos import orchestrator_pb2 as pb

log = logging.getLogger(__name__)

# the answer lost on the way (the connection dropped, the server restarting, the caller's own deadline): the step
# may have run, so it is asked for again at its turn
STEP_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
STEP_RETRY_S = 60.0  # how long a Step is sent again; past it the last error stands
STEP_RETRY_PAUSE_S = 0.5


def turn_of(info: pb.SessionInfo) -> int | None:
    """The turn to send the next Step at; None where the server does not check turns (SessionInfo.steps_by_turn): an
    older one ignored the turn, and a Step sent again ran its action twice."""
    return info.turn if info.steps_by_turn else None


def step_request(session_id: str, action: pb.Action, turn: int | None) -> pb.StepRequest:
    """A Step at `turn` (the last answer's info.turn); None: no turn, never sent again."""
    req = pb.StepRequest(session_id=session_id, action=action)
    if turn is not None:
        req.turn = turn
    return req


def _again(req: pb.StepRequest, e: grpc.RpcError, give_up: float) -> bool:
    if not req.HasField("turn") or e.code() not in STEP_RETRYABLE or time.monotonic() >= give_up:
        return False
    log.info("session %s: step at turn %d lost its answer (%s); asking again", req.session_id, req.turn, e.code().name)
    return True


def send_step(
    call: Callable[[pb.StepRequest], pb.StepResponse], req: pb.StepRequest, retry_s: float = STEP_RETRY_S
) -> pb.StepResponse:
    """`call(req)`, sent again while its answer is lost (STEP_RETRYABLE), for up to `retry_s`."""
    give_up = time.monotonic() + retry_s
    while True:
        try:
            return call(req)
        except grpc.RpcError as e:
            if not _again(req, e, give_up):
                raise
        time.sleep(STEP_RETRY_PAUSE_S)


async def send_step_async(
    call: Callable[[pb.StepRequest], Awaitable[pb.StepResponse]], req: pb.StepRequest, retry_s: float = STEP_RETRY_S
) -> pb.StepResponse:
    """send_step for asyncio."""
    give_up = time.monotonic() + retry_s
    while True:
        try:
            return await call(req)
        except grpc.RpcError as e:
            if not _again(req, e, give_up):
                raise
        await asyncio.sleep(STEP_RETRY_PAUSE_S)
