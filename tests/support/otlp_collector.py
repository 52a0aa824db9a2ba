"""A tiny OTLP trace collector for tests: a gRPC server implementing OTLP's TraceService/Export
on a loopback port, keeping every span it receives with its service's name."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

STATUS_ERROR = trace_pb2.Status.STATUS_CODE_ERROR
KIND_SERVER = trace_pb2.Span.SPAN_KIND_SERVER
KIND_CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT


def _value(any_value) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    links: tuple[str, ...]  # span ids this span links to

    @classmethod
    def of(cls, service: str, span: trace_pb2.Span) -> Span:
        return cls(
            service=service,
            name=span.name,
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_id=span.parent_span_id.hex(),
            kind=span.kind,
            start_ns=span.start_time_unix_nano,
            end_ns=span.end_time_unix_nano,
            attributes={a.key: _value(a.value) for a in span.attributes},
            status_code=span.status.code,
            status_message=span.status.message,
            links=tuple(link.span_id.hex() for link in span.links),
        )

    @property
    def failed(self) -> bool:
        return self.status_code == STATUS_ERROR


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: Collector):
        self._collector = collector

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attributes = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attributes.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                self._collector.add([Span.of(service, s) for s in scope_spans.spans])
        return trace_service_pb2.ExportTraceServiceResponse()


class Collector:
    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, spans: list[Span]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans() if s.trace_id == trace_id]

    def wait_for(self, done: Callable[[list[Span]], bool], timeout_s: float = 30.0) -> list[Span]:
        """Every span received, once `done(spans)` holds (spans reach it a batch delay after they end)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.stop(None)
