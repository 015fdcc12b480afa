"""A real OTLP/gRPC trace receiver (the collector protocol of `opentelemetry-proto`) on a free loopback
port: what an OpenTelemetry collector receives, kept as plain spans for assertions."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    events: tuple[str, ...]
    start_ns: int
    end_ns: int


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request, context):
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        resource.get("service.name", ""), span.name, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), {a.key: _value(a.value) for a in span.attributes},
                        span.status.code, span.status.message, tuple(e.name for e in span.events),
                        span.start_time_unix_nano, span.end_time_unix_nano))
        with self.receiver.lock:
            self.receiver.spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self):
        self.lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def of_request(self, request_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.attributes.get("splitserve.request_id") == request_id]

    def wait_for(self, request_id: str, names: set[str], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """The request's spans once every name in `names` arrived (bounded: fails listing what did)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.of_request(request_id)
            if names <= {s.name for s in spans}:
                return spans
            time.sleep(0.1)
        got = sorted((s.service, s.name) for s in self.of_request(request_id))
        raise AssertionError(f"spans of {request_id}: {got}, waiting for {sorted(names)}")

    def stop(self) -> None:
        self.server.stop(grace=1).wait(5)
