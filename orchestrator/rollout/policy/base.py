"""The policy seam: chat messages and tools in, a Completion with token ids and logprobs out."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from orchestrator.core.policy import Sampling


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for; arguments is the raw JSON string as the model produced it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Completion:
    """One assistant turn: what it said, the tools it called, and, when the server gave them, its tokens."""

    text: str
    tool_calls: list[ToolCall]
    finish_reason: str
    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    logprobs: list[float] | None
    model: str
    raw_message: dict[str, Any]


class ContextFull(Exception):
    """Raised by a policy when the episode's context (JobSpec.max_model_len) has no room for another sampled token.

    Not a failure: the agent loop ends the episode there, TRUNCATED, with its tokens as far as they went."""


class Policy(abc.ABC):
    """The model being trained, as the rollout runner sees it.

    The agent loop calls `for_episode` once per episode and `complete` on what it returns: a stateless policy (chat
    completions) returns itself; a token-in, token-out one returns an object holding that episode's token context.
    """

    def for_episode(self, *, max_model_len: int | None = None) -> Policy:
        """The policy for one episode; `max_model_len` bounds its whole context where the policy counts tokens."""
        return self

    @abc.abstractmethod
    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, user: str = ""
    ) -> Completion:
        """One assistant turn for the conversation so far; user tags the request (the rollout id)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections."""
