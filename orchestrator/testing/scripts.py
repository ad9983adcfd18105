"""Scripts for the scripted policy built from an environment's reference solutions (for demos, checks and tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from orchestrator.core.environment import Environment, Task
from orchestrator.core.tools import tool_names
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


FILLER_ARGUMENTS = {"python": {"code": "print(sum(range({i})))"}, "bash": {"command": "echo turn {i} && ls"}}


def filler_steps(env: Environment, task: Task, turns: int) -> list[Step]:
    """`turns` assistant turns: harmless tool calls (python, else bash), then the task's reference solution."""
    tool = "python" if "python" in tool_names(env.tools) else "bash"
    filler = [
        Step(
            content=f"Step {i}.",
            tool_calls=[
                ScriptedToolCall(name=tool, arguments={k: v.format(i=i) for k, v in FILLER_ARGUMENTS[tool].items()})
            ],
        )
        for i in range(max(0, turns - len(task.reference)))
    ]
    ref = [Step(tool_calls=[ScriptedToolCall(name=inv.name, arguments=dict(inv.arguments))]) for inv in task.reference]
    return filler + ref


def long_script(
    env: Environment, tasks: Sequence[Task], *, turns: int = 6, template: str = "qwen3", **script: object
) -> Script:
    """Each task in `turns` turns (filler_steps), for the qwen3 model double by default: multi-turn episodes whose
    tokens a chat template breaks (tito tests and the tito_overhead bench)."""
    return Script.model_validate(
        {"template": template, "tasks": {t.id: filler_steps(env, t, turns) for t in tasks}, **script}
    )
