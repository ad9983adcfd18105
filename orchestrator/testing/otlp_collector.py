"""A tiny OTLP trace collector on loopback, over gRPC or HTTP/protobuf, that keeps what it receives: for tests and
benchmarks of tracing across processes (the `otel` extra's protobuf classes; imported only by those)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

MAX_BODY = 64 << 20


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector received it; times in Unix nanoseconds, ids as hex."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _spans(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == s.status.STATUS_CODE_ERROR,
                    )
                )
    return out


class OTLPCollector:
    """Keeps every span exported to it. `endpoint` is what `--otlp-endpoint` takes for its `protocol`."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.spans: list[ReceivedSpan] = []
        self.endpoint = ""
        self._lock = threading.Lock()
        self._grpc: grpc.aio.Server | None = None
        self._http: ThreadingHTTPServer | None = None

    def _keep(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            self.spans.extend(_spans(request))

    async def start(self) -> OTLPCollector:
        """Listen on a free loopback port."""
        if self.protocol == "grpc":
            self._grpc = grpc.aio.server()
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._grpc)  # type: ignore[no-untyped-call]
            port = self._grpc.add_insecure_port("127.0.0.1:0")
            await self._grpc.start()
            self.endpoint = f"127.0.0.1:{port}"
        else:
            self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
            threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()
            self.endpoint = f"http://127.0.0.1:{self._http.server_port}"
        return self

    async def close(self) -> None:
        """Stop listening."""
        if self._grpc is not None:
            await self._grpc.stop(0)
        if self._http is not None:
            await asyncio.to_thread(self._http.shutdown)
            self._http.server_close()


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self, collector: OTLPCollector) -> None:
        self._collector = collector

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._collector._keep(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def _handler(collector: OTLPCollector) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if self.path != "/v1/traces" or not 0 < length <= MAX_BODY:
                self.send_error(404 if self.path != "/v1/traces" else 400)
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(length))
            collector._keep(request)
            body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
