"""The training text of the Qwen-like tokenizer: the environments' own prompts, tool schemas and reference answers,
rendered the way the chat template and the policy double write them. `python -m orchestrator.testing.qwen_like
--corpus` refreshes corpus.txt from the installed environments (then rebuild and commit both)."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.core.tools import get_tools
from orchestrator.service.registry import Registry
from orchestrator.testing.qwen_like import REASONING

MAX_CHARS_PER_ENV = 120_000


def _tool_call_texts(name: str, arguments: dict[str, Any]) -> list[str]:
    return [
        json.dumps({"name": name, "arguments": arguments}),
        json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")),
    ]


def collect_corpus(registry: Registry | None = None) -> str:
    """Paragraphs of text from every environment, in a stable order (environment name, then task order)."""
    registry = registry or Registry.from_entry_points()
    paragraphs: list[str] = list(REASONING)
    for registered in registry.all():
        env = registered.env
        own = [env.description, env.system_prompt]
        own += [json.dumps(t.schema()) for t in get_tools(env.tools)]
        for task in env.tasks():
            own.append(task.prompt)
            for inv in task.reference:
                own += _tool_call_texts(inv.name, dict(inv.arguments))
        text, size = [], 0
        for p in own:
            if size + len(p) > MAX_CHARS_PER_ENV:
                break
            text.append(p)
            size += len(p)
        paragraphs += text
    return "\n\n".join(p.strip() for p in paragraphs if p.strip()) + "\n"
