"""What a policy writes reaches traces only capped: a megabyte tool name, tool arguments, model name or error message
becomes a span attribute of at most MAX_ATTRIBUTE_CHARS characters (plus the note of how much was cut)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator.backends.fake import FakeBackend
from orchestrator.core import tracing as tr
from orchestrator.core.otel import OTelTracer
from orchestrator.core.policy import Sampling
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.core.tracing import MAX_ATTRIBUTE_CHARS, Phase, capped
from orchestrator.rollout.episode import run_episode
from orchestrator.rollout.policy.base import Completion, Policy, ToolCall
from orchestrator.service.registry import Registry
from tests.orchestrator.servers import FAKE, FAKE_BASE_IMAGE

HUGE = 1 << 20
LONGEST = MAX_ATTRIBUTE_CHARS + len(f"...[{HUGE} more]")


class HostilePolicy(Policy):
    """Answers once with a huge tool name, huge arguments to `bash`, and a huge model name; then stops."""

    def __init__(self) -> None:
        self.calls = 0

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, user: str = ""
    ) -> Completion:
        self.calls += 1
        calls = [
            ToolCall("c1", "x" * HUGE, "{}"),
            ToolCall("c2", "bash", '{"command": "echo ' + "y" * HUGE + '"}'),
        ]
        return Completion(
            text="",
            tool_calls=calls if self.calls == 1 else [],
            finish_reason="stop",
            prompt_ids=None,
            completion_ids=None,
            logprobs=None,
            model="m" * HUGE,
            raw_message={"role": "assistant", "content": ""},
        )

    async def aclose(self) -> None:
        pass


def _string_attributes(exporter: InMemorySpanExporter) -> list[str]:
    out = [v for s in exporter.get_finished_spans() for v in (s.attributes or {}).values() if isinstance(v, str)]
    out += [s.status.description or "" for s in exporter.get_finished_spans()]
    return out


async def test_policy_output_on_spans_is_capped() -> None:
    exporter = InMemorySpanExporter()
    tracer = OTelTracer(exporter, batch=False)
    env = Registry.from_entry_points().get("python-tool")
    task = env.tasks()[0]
    backend = FakeBackend(FAKE)
    sandbox = await backend.create(SandboxSpec(image=FAKE_BASE_IMAGE, limits=env.limits))
    try:
        root = tracer.start("rollout", 0.0)
        await run_episode(env, task, sandbox, HostilePolicy(), Sampling(), 4, "r", [], span=root)
        root.end(1.0)
    finally:
        await sandbox.close()
        await backend.close()
    spans = exporter.get_finished_spans()
    tools = [s for s in spans if s.name == "tool"]
    assert len(tools) == 2 and {s.name for s in spans} == {"rollout", "policy", "tool"}
    names = [str((s.attributes or {})[tr.TOOL_NAME]) for s in tools]
    assert names[0].startswith("xxx") and names[1] == "bash"
    size = (tools[1].attributes or {})[tr.TOOL_ARGUMENTS_BYTES]
    assert isinstance(size, int) and size > HUGE, "the true size is recorded, not the bytes"
    values = _string_attributes(exporter)
    assert max(map(len, values)) <= LONGEST
    arguments = str((tools[1].attributes or {})[tr.TOOL_ARGUMENTS])
    assert arguments.startswith('{"command": "echo yyy') and arguments.endswith(
        f"...[{HUGE + 20 - MAX_ATTRIBUTE_CHARS} more]"
    )


def test_an_error_message_on_a_span_is_capped() -> None:
    exporter = InMemorySpanExporter()
    root = OTelTracer(exporter, batch=False).start("rollout", 0.0)
    with pytest.raises(RuntimeError), Phase(root, "scoring"):
        raise RuntimeError("e" * HUGE)
    (scoring,) = exporter.get_finished_spans()
    assert scoring.status.description is not None and len(scoring.status.description) <= LONGEST
    assert (scoring.attributes or {})["error.type"] == "RuntimeError"


def test_capped() -> None:
    assert capped("abc") == "abc"
    assert capped("a" * (MAX_ATTRIBUTE_CHARS + 5)) == "a" * MAX_ATTRIBUTE_CHARS + "...[5 more]"
