"""The OpenTelemetry implementation of the tracing seam (orchestrator/core/tracing.py); the `otel` extra. Imported
only when tracing is configured. Each tracer owns its provider (no global OpenTelemetry state is set), so tests and
processes keep their own."""

from __future__ import annotations

import logging
import re
import threading
import time
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

from orchestrator.core.tracing import MAX_ATTRIBUTE_CHARS, Attributes, AttributeValue, Span, capped

# W3C trace context, version 00 (what the SDK's propagator reads, without building a carrier and a context per call)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
log = logging.getLogger(__name__)

MAX_SPAN_ATTRIBUTES = 32
# the longest a shutdown waits for the last spans to be exported: the OTLP exporters retry an unreachable collector
# with a backoff, and one that accepts and never answers holds each export to its timeout, so a worker's exit (and
# the control plane's, and asyncio.run's wait for its threads) took 10-30 s more
SHUTDOWN_S = 5.0
MAX_QUEUED_SPANS = 8192  # spans waiting for export; beyond, new ones are dropped (counted by the SDK) not buffered


def _clean(attributes: Attributes | None) -> dict[str, AttributeValue]:
    if not attributes:
        return {}
    return {k: capped(v) if isinstance(v, str) else v for k, v in attributes.items()}


class OTelSpan:
    """A span of the SDK, on monotonic times."""

    __slots__ = ("_context", "_span", "_tracer")

    def __init__(self, tracer: OTelTracer, span: trace.Span) -> None:
        self._tracer = tracer
        self._span = span
        self._context: Context | None = None  # as a parent: made once, on its first child

    @property
    def traceparent(self) -> str:
        """The W3C traceparent of this span ("" for an invalid one)."""
        c = self._span.get_span_context()
        return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}" if c.is_valid else ""

    def open(self, name: str, start: float, attributes: Attributes | None = None) -> Span:
        """A child of this span."""
        if self._context is None:
            self._context = trace.set_span_in_context(self._span)
        return self._tracer._open(name, start, attributes, self._context)

    def set(self, attributes: Attributes) -> None:
        """Add attributes (string values capped)."""
        self._span.set_attributes(_clean(attributes))

    def end(self, end: float, error: BaseException | None = None) -> None:
        """End at `end`; an error marks the span failed with its type and capped message."""
        if error is not None:
            self._span.set_attribute("error.type", type(error).__name__)
            self._span.set_status(Status(StatusCode.ERROR, capped(str(error) or type(error).__name__)))
        self._span.end(end_time=self._tracer.wall_ns(end))


class OTelTracer:
    """Spans through an SDK TracerProvider of its own, to `exporter` (batched, or one by one with `batch=False`)."""

    enabled = True

    def __init__(
        self, exporter: SpanExporter, service: str = "envfleet", *, batch: bool = True, sample_ratio: float = 1.0
    ) -> None:
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": service}),
            # parent-based: a worker's spans follow the choice made for the rollout's root on the control plane
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
            span_limits=SpanLimits(
                max_span_attributes=MAX_SPAN_ATTRIBUTES,
                max_span_attribute_length=MAX_ATTRIBUTE_CHARS + 32,  # a second bound behind `capped`
                max_events=0,
                max_links=0,
            ),
            shutdown_on_exit=False,  # library code installs no atexit handler; the owner calls shutdown()
        )
        processor = BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUED_SPANS) if batch else None
        self._provider.add_span_processor(processor or SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("envfleet")
        # monotonic seconds -> wall-clock ns, from one pair of readings: span durations stay the monotonic ones
        self._wall0_ns = time.time_ns()
        self._mono0 = time.monotonic()

    @classmethod
    def otlp(cls, endpoint: str, protocol: str, service: str, sample_ratio: float = 1.0) -> OTelTracer:
        """Batched OTLP export over gRPC or HTTP/protobuf."""
        exporter: SpanExporter
        if protocol == "http":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

            parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
            path = parts.path.rstrip("/")
            url = parts._replace(path=path if path.endswith("/v1/traces") else f"{path}/v1/traces").geturl()
            exporter = HTTPExporter(endpoint=url)
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter

            secure = endpoint.startswith("https://")
            target = endpoint.split("://", 1)[1] if "://" in endpoint else endpoint
            exporter = GRPCExporter(endpoint=target, insecure=not secure)
        return cls(exporter, service, sample_ratio=sample_ratio)

    def wall_ns(self, monotonic_s: float) -> int:
        """A monotonic reading as Unix-epoch nanoseconds."""
        return self._wall0_ns + round((monotonic_s - self._mono0) * 1e9)

    def start(self, name: str, start: float, attributes: Attributes | None = None) -> Span:
        """The root span of a new trace."""
        return self._open(name, start, attributes, None)

    def remote(self, traceparent: str) -> Span:
        """The span a traceparent names, as a parent (an invalid one parents nothing: its children start traces)."""
        m = _TRACEPARENT.fullmatch(traceparent)
        if m is None:
            return OTelSpan(self, trace.INVALID_SPAN)
        trace_id, span_id, flags = int(m[1], 16), int(m[2], 16), int(m[3], 16)
        context = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
        return OTelSpan(self, NonRecordingSpan(context) if context.is_valid else trace.INVALID_SPAN)

    def _open(self, name: str, start: float, attributes: Attributes | None, context: Context | None) -> Span:
        span = self._tracer.start_span(
            name,
            context=context,
            attributes=_clean(attributes),
            start_time=self.wall_ns(start),
            record_exception=False,
            set_status_on_exception=False,
        )
        return OTelSpan(self, span)

    def force_flush(self) -> None:
        """Export what is buffered now."""
        self._provider.force_flush()

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter, for at most SHUTDOWN_S; what is left then is dropped."""
        ending = threading.Thread(target=self._provider.shutdown, name="otel-shutdown", daemon=True)
        ending.start()
        ending.join(SHUTDOWN_S)
        if ending.is_alive():
            log.warning("the trace collector took no spans for %gs; the last ones are dropped", SHUTDOWN_S)
