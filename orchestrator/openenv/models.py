"""The OpenEnv wire models of an envfleet episode: what a client sends (an action, reset's options) and gets back.

    {"name": "python", "arguments": {"code": "print(6*7)"}}   a tool call ("arguments": an object or JSON text)
    {"answer": "42"}                                          a final answer (like a completion without tool calls)

An observation's `text` is the task prompt after reset and the tool's output after a step; `metadata` holds the
rest (on reset the session, the opening messages and the tools' JSON schemas; on the last step the status).
"""

from __future__ import annotations

import json
from typing import Any

from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_ID = 128
MAX_TOOL_NAME = 128


class EnvfleetAction(Action):
    """One action: a tool call (`name`, `arguments`, optional `id`) or a final answer (`answer`)."""

    name: str | None = Field(None, min_length=1, max_length=MAX_TOOL_NAME, description="the tool to call")
    arguments: dict[str, Any] | str = Field(default_factory=dict, description="the tool's arguments")
    id: str = Field("", max_length=MAX_ID, description="the tool call's id (default: one per turn)")
    answer: str | None = Field(None, description="the final answer; ends the episode")

    @model_validator(mode="after")
    def _one_kind(self) -> EnvfleetAction:
        # PydanticCustomError, not ValueError: OpenEnv sends the errors back as JSON, and a ValueError in their
        # context would not serialize (the frame would fail and end the session)
        if (self.name is None) == (self.answer is None):
            raise PydanticCustomError(
                "envfleet_action", "give either a tool call ('name' and 'arguments') or a final answer ('answer')"
            )
        if self.answer is not None and (self.arguments or self.id):
            raise PydanticCustomError("envfleet_action", "'arguments' and 'id' belong to a tool call, not an answer")
        return self

    def arguments_json(self) -> str:
        """The arguments as the JSON text the tool call carries."""
        return self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments)


class EnvfleetObservation(Observation):
    """The task prompt (after reset) or the tool's output (after a step); `done`, `reward`, `metadata` as OpenEnv's.

    `reward` is None after reset, 0.0 until the last step, the score on the last step, and None when the episode
    failed for a reason that is not the policy's (metadata `status` INFRA_ERROR, ENV_ERROR or TIMEOUT)."""

    text: str = ""


class EnvfleetState(State):
    """The session behind the episode: `episode_id` is its id, `step_count` its turn."""

    env: str = ""
    task_id: str = ""
    max_turns: int = 0
    done: bool = False
    status: str = ""


class ResetOptions(BaseModel):
    """What reset takes: a task by id, or one drawn with a seed (neither: at random), and a turn limit."""

    model_config = ConfigDict(extra="forbid")

    seed: int | None = Field(None, ge=0, lt=1 << 63)
    task_id: str = Field("", max_length=MAX_ID)
    max_turns: int = Field(0, ge=0, le=1000, description="0: the environment's default")
    episode_id: str | None = Field(None, max_length=255, description="ignored: the episode id is the session id")
