"""Scripts for the scripted policy built from an environment's reference solutions (for demos, checks and tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from orchestrator.core.environment import Environment, Task
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step

Mode = Literal["solve", "wrong", "empty"]


def reference_script(
    env: Environment, tasks: Sequence[Task] | None = None, *, mode: Mode = "solve", latency_s: float = 0.0
) -> Script:
    """Replay each task's reference tool calls.

    `wrong` skips the work (every call but submit) and submits a wrong answer; `empty` submits nothing at all.
    """
    steps: dict[str, list[Step]] = {}
    for task in tasks if tasks is not None else env.tasks():
        calls = []
        for inv in task.reference:
            args = dict(inv.arguments)
            if inv.name != "submit" and mode != "solve":
                continue
            if inv.name == "submit" and mode != "solve":
                args = {"answer": "definitely wrong"} if mode == "wrong" else {}
            calls.append(Step(tool_calls=[ScriptedToolCall(name=inv.name, arguments=args)]))
        steps[task.id] = calls
    return Script(tasks=steps, latency_s=latency_s)
