"""Rollout traces: the seam. Each rollout is one trace (rollout > queue, attempt > acquire, setup, episode > policy and
tool calls, scoring, release); the runner measures each phase once and the same two clock readings become both the
rollout's `Timing` and the span, so a trace adds up to its timing.

Off by default: `NOOP_TRACER` does nothing and imports nothing. `make_tracer(config)` with an OTLP endpoint imports
the OpenTelemetry implementation (orchestrator/core/otel.py, the `otel` extra) only then. A trace crosses from the
control plane to a worker process as a W3C `traceparent` string (`Span.traceparent`, `Tracer.remote`).

Times are `time.monotonic()` seconds, as every measurement in the runner is; the implementation turns them into
wall-clock timestamps. Attribute values that come from the policy or the task (tool names, arguments, model names,
error messages) are cut to `MAX_ATTRIBUTE_CHARS` by `capped`, the one place that bounds them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.core.errors import ConfigError

if TYPE_CHECKING:
    from typing import Self

AttributeValue = str | int | float | bool
Attributes = Mapping[str, AttributeValue]
MAX_ATTRIBUTE_CHARS = 256  # the longest string attribute value a span carries (policy output is hostile)

# attribute names, one place (OpenTelemetry's gen_ai.* names where a convention exists)
ROLLOUT_ID = "envfleet.rollout.id"
JOB_ID = "envfleet.job.id"
ENV = "envfleet.env"
TASK_ID = "envfleet.task.id"
SAMPLE_INDEX = "envfleet.sample_index"
STATUS = "envfleet.status"
ATTEMPT = "envfleet.attempt"
ATTEMPTS = "envfleet.attempts"
REWARD = "envfleet.reward"
SANDBOX_WARM = "envfleet.sandbox.warm"
TURN = "envfleet.turn"
TOOL_NAME = "gen_ai.tool.name"
TOOL_ARGUMENTS = "envfleet.tool.arguments"
TOOL_ARGUMENTS_BYTES = "envfleet.tool.arguments_bytes"
TOOL_EXIT_CODE = "envfleet.tool.exit_code"
TOOL_TIMED_OUT = "envfleet.tool.timed_out"
MODEL = "gen_ai.response.model"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASON = "gen_ai.response.finish_reasons"


def capped(value: str, limit: int = MAX_ATTRIBUTE_CHARS) -> str:
    """A string attribute value cut to `limit` characters, saying how much was cut."""
    if len(value) <= limit:
        return value
    return value[:limit] + f"...[{len(value) - limit} more]"


class TracingConfig(BaseModel):
    """Where traces go. Without an endpoint, tracing is off and OpenTelemetry is never imported."""

    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str | None = Field(
        None, description="OTLP collector: grpc host:port or http(s)://host:port; http: a base URL or its /v1/traces"
    )
    otlp_protocol: Literal["grpc", "http"] = "grpc"
    otlp_sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="share of rollouts traced, chosen by trace id (a worker follows its rollout's choice); "
        "a traced light rollout costs ~3x its CPU (bench: tracing), so a large fleet samples",
    )


class Span(Protocol):
    """An open span: add children and attributes, then end it."""

    @property
    def traceparent(self) -> str:
        """This span as a W3C traceparent ("" when not traced), for a child in another process."""
        ...

    def open(self, name: str, start: float, attributes: Attributes | None = None) -> Span:
        """An open child span that started at `start`."""
        ...

    def set(self, attributes: Attributes) -> None:
        """Add attributes (string values are capped)."""
        ...

    def end(self, end: float, error: BaseException | None = None) -> None:
        """End the span at `end`; an error marks it failed, with the error's type and (capped) message."""
        ...


class Tracer(Protocol):
    """Starts the root (or remote-parented) span of a rollout's trace; flushes on shutdown."""

    @property
    def enabled(self) -> bool:
        """Whether spans are recorded at all."""
        ...

    def start(self, name: str, start: float, attributes: Attributes | None = None) -> Span:
        """The root span of a new trace, started at `start`."""
        ...

    def remote(self, traceparent: str) -> Span:
        """A handle on a span of another process (its W3C traceparent): `open` makes children of it, in its trace;
        `set` and `end` do nothing. An empty or invalid traceparent gives children that are roots of new traces."""
        ...

    def shutdown(self) -> None:
        """Export what is buffered and stop (blocking: call it from a thread in async code)."""
        ...


class _NoopSpan:
    traceparent = ""

    def open(self, name: str, start: float, attributes: Attributes | None = None) -> Span:
        return self

    def set(self, attributes: Attributes) -> None:
        pass

    def end(self, end: float, error: BaseException | None = None) -> None:
        pass


class _NoopTracer:
    enabled = False

    def start(self, name: str, start: float, attributes: Attributes | None = None) -> Span:
        return NOOP_SPAN

    def remote(self, traceparent: str) -> Span:
        return NOOP_SPAN

    def shutdown(self) -> None:
        pass


NOOP_SPAN: Span = _NoopSpan()
NOOP_TRACER: Tracer = _NoopTracer()


class Phase:
    """One measured stretch of a rollout: `with Phase(parent, "setup") as p: ...`, then `p.seconds` goes into
    Timing and the same readings made the child span (failed, with the error, when the block raised)."""

    __slots__ = ("attributes", "end", "name", "parent", "seconds", "span", "start")

    def __init__(self, parent: Span, name: str, attributes: Attributes | None = None) -> None:
        self.parent = parent
        self.name = name
        self.attributes = attributes
        self.span: Span = NOOP_SPAN
        self.start = self.end = self.seconds = 0.0

    def __enter__(self) -> Self:
        self.start = time.monotonic()
        self.span = self.parent.open(self.name, self.start, self.attributes)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end = time.monotonic()
        self.seconds = self.end - self.start
        self.span.end(self.end, exc)


def make_tracer(config: TracingConfig | None, service: str) -> Tracer:
    """The tracer a process uses: no-op without an endpoint; else OTLP export, importing OpenTelemetry now."""
    if config is None or not config.otlp_endpoint:
        return NOOP_TRACER
    try:
        from orchestrator.core.otel import OTelTracer  # the `otel` extra; imported only when tracing is on
    except ImportError as e:
        raise ConfigError(
            f"otlp_endpoint is set but OpenTelemetry is not installed ({e.name}): pip install 'envfleet[otel]'"
        ) from None
    return OTelTracer.otlp(config.otlp_endpoint, config.otlp_protocol, service, config.otlp_sample_ratio)
