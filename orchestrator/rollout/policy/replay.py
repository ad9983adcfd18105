"""A policy that is no model: it replays each task's reference solution, one tool call per turn, in process.

For measuring and simulating the fleet itself (`PolicyEndpoint(base_url="replay://reference")`): it costs no HTTP
and no model time, so what is measured is the orchestration. Its rollouts carry no token ids.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.core.environment import Environment, Task
from orchestrator.core.errors import PolicyResponseError
from orchestrator.core.policy import Sampling
from orchestrator.rollout.policy.base import Completion, Policy, ToolCall


class ReplayPolicy(Policy):
    """Answers turn n of a rollout with the n-th call of its task's reference; past the end, with a final answer."""

    def __init__(self, env: Environment) -> None:
        self.model = f"replay:{env.ref()}"
        self._tasks: dict[str, Task] = {t.id: t for t in env.tasks()}

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, user: str = ""
    ) -> Completion:
        """The next reference call of the task named in `user` (a rollout id, job:task:sample)."""
        _, _, rest = user.partition(":")
        task = self._tasks.get(rest.rpartition(":")[0])
        if task is None:
            raise PolicyResponseError(f"replay policy: no task for rollout {user!r}")
        turn = sum(m.get("role") == "assistant" for m in messages)
        if turn >= len(task.reference):
            return Completion(
                "done", [], "stop", None, None, None, self.model, {"role": "assistant", "content": "done"}
            )
        inv = task.reference[turn]
        call = ToolCall(id=f"call_{turn}", name=inv.name, arguments=json.dumps(dict(inv.arguments)))
        raw = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        }
        return Completion("", [call], "tool_calls", None, None, None, self.model, raw)

    async def aclose(self) -> None:
        """Nothing to release."""
