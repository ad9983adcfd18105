"""What an environment author imports: the Environment base class, tasks, episodes, rubrics, tools and the sandbox
interface. Core types only: importing this loads no Docker and no httpx (a test checks it).

    from environments.sdk import Environment, Rubric, Task

    class MyEnv(Environment):
        name = "my-env"
        ...
"""

from orchestrator.core.environment import (
    Environment,
    Episode,
    Finish,
    RewardFn,
    Rubric,
    Score,
    ScoringContext,
    Task,
    ToolInvocation,
)
from orchestrator.core.errors import SandboxFileNotFoundError
from orchestrator.core.image_spec import ImageSpec
from orchestrator.core.models import ToolCallRecord, Turn
from orchestrator.core.sandbox import ExecResult, Limits, Sandbox
from orchestrator.core.tools import BUILTIN_TOOLS, Tool, ToolResult, format_exec, get_tools

__all__ = [
    "BUILTIN_TOOLS",
    "Environment",
    "Episode",
    "ExecResult",
    "Finish",
    "ImageSpec",
    "Limits",
    "RewardFn",
    "Rubric",
    "Sandbox",
    "SandboxFileNotFoundError",
    "Score",
    "ScoringContext",
    "Task",
    "Tool",
    "ToolCallRecord",
    "ToolInvocation",
    "ToolResult",
    "Turn",
    "format_exec",
    "get_tools",
]
