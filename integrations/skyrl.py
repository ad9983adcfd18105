"""SkyRL: a `skyrl_gym` BaseTextEnv over an envfleet session, registered as `envfleet`.

SkyRL's generator keeps the tokens (it appends the sampled ids and tokenizes each observation as a delta); this
environment is text in, text out: `init` resets a session and returns its opening messages, `step` parses the
assistant's text for tool calls (a named tito parser, `hermes` by default), runs each as one session Step and
returns the tool results as `tool` messages; the reward is the episode's, on the last step.

    import integrations.skyrl  # registers "envfleet"
    env = skyrl_gym.make("envfleet", env_config={"server": "127.0.0.1:50051", "env": "python-tool"},
                         extras={"task_id": "py-000"})

SkyRL renders the opening messages without a tools argument, so by default the tool schemas are written into the
system message the way a Qwen/Hermes template writes them. An episode that ends without a reward to learn from
(INFRA_ERROR, ENV_ERROR, TIMEOUT) raises EpisodeFailedError: SkyRL has no way to mask a sample from a reward.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from integrations.episode import tool_message
from integrations.session import Message, Opening, StepResult, SyncSessions
from orchestrator.client.busy import BUSY_WAIT_S
from orchestrator.rollout.tito import get_parser
from orchestrator.rollout.tito.reasoning import answer_text, parse_turn

ENV_ID = "envfleet"


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The tool schemas and the call format, as Qwen/Hermes chat templates put them in the system message."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
        ' XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def opening_messages(opening: Opening, with_tools: bool) -> list[Message]:
    """The session's opening messages, the tool schemas appended to the system message (one is added if none)."""
    messages = [dict(m) for m in opening.messages]
    if with_tools and opening.tools:
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] += tools_system_text(opening.tools)
        else:
            messages.insert(0, {"role": "system", "content": tools_system_text(opening.tools).lstrip()})
    return messages


class EnvfleetTextEnv(BaseTextEnv):  # type: ignore[misc]
    """One envfleet session per episode. env_config: server, env, token, tool_parser, tools_in_system_prompt,
    busy_wait_s (how long a Reset waits while the fleet is full; 0: fail at once), thinking_in_prompt (true where the
    chat template ends the generation prompt with `<think>`, as DeepSeek-R1's and Qwen3-Thinking-2507's do: each turn
    starts inside the thinking, which is no answer and holds no call); extras: task_id (or seed), env (overrides
    env_config's), max_turns."""

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        config = dict(env_config or {})
        extras = dict(extras or {})
        self.env_ref = str(extras.get("env") or config.get("env") or "")
        if not self.env_ref:
            raise ValueError("no envfleet environment: set env_config.env or extras.env")
        self.task_id = str(extras.get("task_id", ""))
        seed = extras.get("seed")
        self.seed = int(seed) if seed is not None else None
        self.max_turns = int(extras.get("max_turns") or config.get("max_turns") or 0)
        self.with_tools = bool(config.get("tools_in_system_prompt", True))
        self.parser = get_parser(str(config.get("tool_parser", "hermes")))
        self.thinking_in_prompt = bool(config.get("thinking_in_prompt", False))
        self.sessions = SyncSessions(
            str(config.get("server", "127.0.0.1:50051")),
            token=config.get("token") or None,
            busy_wait_s=float(config.get("busy_wait_s", BUSY_WAIT_S)),
        )
        self.opening: Opening | None = None
        self.last: StepResult | None = None

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        """Reset a session (the dataset's prompt is replaced by the environment's own opening messages). Whatever
        raises releases the session and the connection first (SkyRL closes an environment on success only)."""
        with self._closed_if_raising():
            self.close_session()
            self.opening = self.sessions.reset(self.env_ref, self.task_id, seed=self.seed, max_turns=self.max_turns)
        self.turns = 0
        info = {"task_id": self.opening.task_id, "tools": self.opening.tools, "max_turns": self.opening.max_turns}
        return opening_messages(self.opening, self.with_tools), info

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Run the turn's tool calls (or its final answer); the reward is the episode's on the last step. Whatever
        raises (a failed episode, the server gone) releases the session and the connection first: SkyRL closes an
        environment on success only, and the sandbox was held until the session's idle expiry."""
        if self.opening is None:
            raise RuntimeError("call init() before step()")
        with self._closed_if_raising():
            return self._step(action)

    def _step(self, action: str) -> BaseTextEnvStepOutput:
        assert self.opening is not None
        self.turns += 1
        sid = self.opening.session_id
        # as the fleet's tito turns
        content, calls = parse_turn(self.parser, action, self.opening.tools, opened=self.thinking_in_prompt)
        observations: list[Message] = []
        if not calls:
            result = self.sessions.step(sid, answer_text(content))
        for call in calls:
            result = self.sessions.step(sid, call)
            observations.append(tool_message(call, result))
            if result.done:
                break
        self.last = result
        if not result.done:
            return BaseTextEnvStepOutput(observations=observations, reward=0.0, done=False, metadata={})
        self.close_session()
        if not result.scored:
            raise result.failure()
        assert result.status is not None and result.reward is not None
        metadata = {"status": result.status.value, "reward_components": result.reward_components}
        return BaseTextEnvStepOutput(observations=observations, reward=result.reward, done=True, metadata=metadata)

    def get_metrics(self) -> dict[str, Any]:
        """The last episode's reward components and metrics."""
        if self.last is None:
            return {}
        return {**self.last.reward_components, **self.last.metrics}

    @contextlib.contextmanager
    def _closed_if_raising(self) -> Iterator[None]:
        """Release the session and the connection when the block raises (SkyRL closes an environment on success
        only), then raise what ended it."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the error that ended it is the one to see
                self.close()
            raise

    def close_session(self) -> None:
        """Release the session's sandbox, if one is held."""
        if self.opening is not None:
            opening, self.opening = self.opening, None
            self.sessions.close(opening.session_id)

    def close(self) -> None:
        """Release the sandbox and the connection; safe to call again."""
        try:
            self.close_session()
        finally:
            self.sessions.shutdown()


def register() -> None:
    """Register EnvfleetTextEnv with skyrl_gym as `envfleet` (done on import; safe to call again)."""
    if ENV_ID not in skyrl_gym.registry:
        skyrl_gym.register(id=ENV_ID, entry_point=f"{__name__}:EnvfleetTextEnv")


register()
