"""A session as a `gymnasium.Env` (needs the `gymnasium` package): text observations, actions as JSON strings.

    env = SessionEnv("127.0.0.1:50051", "python-tool")
    prompt, info = env.reset(seed=7)            # info["tools"]: the OpenAI tool schemas
    obs, reward, terminated, truncated, info = env.step('{"name": "python", "arguments": {"code": "print(6*7)"}}')
    obs, reward, terminated, truncated, info = env.step('{"name": "submit", "arguments": {"answer": "42"}}')
    env.close()

An action is a JSON object `{"name": tool, "arguments": {...}}` (a tool call) or `{"answer": text}`; any other text
is the final answer, like a completion without tool calls. The reward is 0 until the last step. When the episode
fails for a reason that is not the policy's (status INFRA_ERROR, ENV_ERROR or TIMEOUT) there is no reward to learn
from: step() raises SessionFailedError (or, with on_failure="truncate", returns truncated=True, reward NaN and
info["scored"] = False so the sample can be masked: a wrapper that reads no info learns nothing from it silently, as
it would from a 0).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Literal

import grpc
import gymnasium
from gymnasium import spaces

from orchestrator.client.auth import ClientTLS, bearer_metadata, sync_channel
from orchestrator.client.busy import BUSY_WAIT_S, retry_busy_sync
from orchestrator.client.convert import step_outcome
from orchestrator.client.step_retry import send_step, step_request, turn_of
from orchestrator.core.errors import EnvfleetError
from orchestrator.core.text import as_text
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc

SCORED = ("OK", "TRUNCATED")


class SessionFailedError(EnvfleetError, RuntimeError):
    """The episode ended without a usable reward (infrastructure, environment or time failure)."""

    def __init__(self, status: str, kind: str, message: str) -> None:
        super().__init__(f"episode ended with {status}: {kind}: {message}")
        self.status = status


MAX_CALL_ID = 128  # the server's cap on a tool call's id


class AnyText(spaces.Text):
    """Any string up to max_length characters (gymnasium's Text limits the charset; model output does not)."""

    def contains(self, x: Any) -> bool:
        """A str of acceptable length."""
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


def parse_action(text: str) -> pb.Action:
    """A tool call for `{"name": ..., "arguments": ...}`, else a final answer (`{"answer": ...}` or the text). Each
    string made text (as_text): a `\\ud800` escape decodes to a lone surrogate, which protobuf refuses (UTF-8 has
    none), and it raised out of env.step."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, and an integer past Python's 4,300 digits
        return pb.Action(final_answer=as_text(text))
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]:
        args = obj.get("arguments", {})
        call_id = as_text(str(obj.get("id", "")))
        return pb.Action(
            tool_call=pb.ToolCall(
                id=call_id if len(call_id) <= MAX_CALL_ID else "",  # the server's cap: past it, the server names it
                name=as_text(obj["name"]),
                arguments=as_text(args) if isinstance(args, str) else json.dumps(args),
            )
        )
    if isinstance(obj, dict) and isinstance(obj.get("answer"), str) and set(obj) == {"answer"}:
        return pb.Action(final_answer=as_text(obj["answer"]))
    return pb.Action(final_answer=as_text(text))


class SessionEnv(gymnasium.Env[str, str]):
    """One environment of an orchestrator, one session (one sandbox) per episode."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        target: str,
        env: str,
        *,
        token: str | None = None,
        tls: ClientTLS | None = None,
        insecure: bool = False,
        max_turns: int = 0,
        timeout_s: float = 300.0,
        step_timeout_s: float | None = None,
        max_text: int = 1 << 20,
        on_failure: Literal["raise", "truncate"] = "raise",
        busy_wait_s: float = BUSY_WAIT_S,
    ) -> None:
        self.env_ref = env
        self.max_turns = max_turns
        self.timeout_s = timeout_s  # Reset's and Close's deadline
        # Step's: None, the server's own bound (the tool call, then a final step's grading, up to the grader's own
        # timeouts, past timeout_s for some); a server that stops answering is found by keepalive. Shorter, a final
        # step cut here was scored all the same, its reward lost (and the episode over when retried)
        self.step_timeout_s = step_timeout_s
        self.on_failure = on_failure
        # how long reset() asks again while the server is busy (the host full, the tenant's sessions at their cap:
        # orchestrator/client/busy.py); 0: it raises the first RESOURCE_EXHAUSTED
        self.busy_wait_s = busy_wait_s
        self.observation_space = AnyText(max_text, min_length=0)
        self.action_space = AnyText(max_text, min_length=0)
        self._metadata = bearer_metadata(token)
        self._channel = sync_channel(target, token=token, tls=tls, insecure=insecure)
        self._stub = pb_grpc.SessionServiceStub(self._channel)
        self.session_id: str | None = None
        # the session's turn, as its last answer said: a Step whose answer is lost is sent again at it (None: the
        # server does not check turns, or the episode is over)
        self._turn: int | None = None

    def _close_session(self) -> None:
        sid, self.session_id = self.session_id, None
        if sid is None:
            return
        try:
            self._stub.CloseSession(
                pb.CloseSessionRequest(session_id=sid), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # already expired: nothing to release
                raise

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode (a new session): on options["task_id"], else on a task drawn with the seed."""
        super().reset(seed=seed)
        self._close_session()
        task_id = str((options or {}).get("task_id", ""))
        req = pb.ResetRequest(env=self.env_ref, task_id=task_id, max_turns=self.max_turns)
        if not task_id:
            req.seed = int(self.np_random.integers(0, 2**31 - 1))
        reset = functools.partial(self._stub.Reset, req, timeout=self.timeout_s, metadata=self._metadata)
        r = retry_busy_sync(reset, self.busy_wait_s)
        self.session_id, self._turn = r.session_id, turn_of(r.info)
        info: dict[str, Any] = {
            "env": r.info.env,
            "task_id": r.info.task_id,
            "max_turns": r.info.max_turns,
            "messages": [{"role": m.role, "content": m.text} for m in r.observation.messages],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": json.loads(t.parameters_json),
                    },
                }
                for t in r.observation.tools
            ],
        }
        return r.observation.text, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Send one action; the reward is 0.0 until the episode ends."""
        if self.session_id is None:
            raise RuntimeError("call reset() before step()")
        call = functools.partial(self._stub.Step, timeout=self.step_timeout_s, metadata=self._metadata)
        r = send_step(call, step_request(self.session_id, parse_action(action), self._turn))
        self._turn = None if r.terminated or r.truncated else turn_of(r.info)
        outcome = step_outcome(r)  # a status newer than this client: not scored
        status = outcome.status.value if outcome.status is not None else ""  # the models' short name ("OK")
        info: dict[str, Any] = {
            "turn": r.info.turn,
            "status": status,
            "reward_components": dict(r.reward_components),
            "metrics": dict(r.metrics),
            "scored": status in SCORED or not status,
        }
        if status and status not in SCORED:
            info["error"] = {"kind": outcome.error_kind, "message": outcome.error_message}
            if self.on_failure == "raise":
                raise SessionFailedError(status, outcome.error_kind, outcome.error_message)
        reward = outcome.reward if outcome.reward is not None else math.nan if not info["scored"] else 0.0
        return r.observation, float(reward), r.terminated, r.truncated, info

    def close(self) -> None:
        """End the session (destroying its sandbox) and the connection; safe to call twice."""
        try:
            self._close_session()
        finally:
            self._channel.close()
