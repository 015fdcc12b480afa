"""Request tracing with OpenTelemetry: spans exported over OTLP/gRPC, and the W3C trace context they travel
in between processes (docs/operations.md#tracing shows the spans of a request).

Off unless `configure(endpoint, service)` was given an endpoint (`otlp_traces_endpoint`). Off, every call
here returns at once, without importing OpenTelemetry or making a span: `span()` hands back one shared
no-op context manager and `context_of()` returns None, so a message's `trace_context` stays None.

A span's context crosses a process boundary as a `TraceContext` (common/messages.py): the W3C
`traceparent` (and `tracestate`) plus the client's request id, so that each process labels its spans
with the id the client knows (`splitserve.request_id`), not the attempt id it works under.

    configure("http://otel-collector:4317", "splitserve-router")
    with span("splitserve.request", None, request_id="r1") as root:     # parent: the current context
        carrier = context_of(root, "r1")                                # into a GenerateRequest
    ...                                                                 # in the worker:
    with span("splitserve.prefill", request.trace_context): ...

Spans measured after the fact (a request's wait in a queue, known once it is scheduled) are made with
`record(name, parent, start_ns, end_ns)`; times are `time.time_ns()`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from common.messages import TraceContext

REQUEST_ID = "splitserve.request_id"
EXPORT_DELAY_MS = 1000  # how long finished spans wait to be batched (the SDK's default is 5 s)
_NULL = contextlib.nullcontext()


@dataclass
class _State:
    endpoint: str | None = None
    tracer: Any = None  # opentelemetry.trace.Tracer, while on
    provider: Any = None  # opentelemetry.sdk.trace.TracerProvider, while on


_state = _State()
_lock = threading.Lock()


def enabled() -> bool:
    return _state.tracer is not None


def configure(endpoint: str | None, service_name: str) -> None:
    """Turns tracing on, exporting to `endpoint` under `service_name` (None: off). A process keeps its own
    provider (never the global one, which a process may set once): configuring again replaces it."""
    with _lock:
        if endpoint == _state.endpoint and (endpoint is None or _state.tracer is not None):
            return
        _shutdown_locked()
        if endpoint is None:
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from common.metric_identity import splitserve_version

        resource = Resource.create({"service.name": service_name, "service.version": splitserve_version()})
        provider = TracerProvider(resource=resource, shutdown_on_exit=True)
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        _state.endpoint, _state.provider = endpoint, provider
        _state.tracer = provider.get_tracer("splitserve")


def shutdown() -> None:
    """Exports what is left and turns tracing off."""
    with _lock:
        _shutdown_locked()


def flush(timeout_s: float = 5.0) -> bool:
    """Exports the finished spans now (True when all went out in time)."""
    provider = _state.provider
    return True if provider is None else bool(provider.force_flush(int(timeout_s * 1000)))


def _shutdown_locked() -> None:
    provider = _state.provider
    _state.endpoint = _state.tracer = _state.provider = None
    if provider is not None:
        provider.shutdown()


def span(name: str, parent: TraceContext | None = None, *, kind: str = "internal", **attributes):
    """A context manager timing a span (yielding it; None when off). `parent`: the remote context it continues;
    None: the current span's (or a new trace). `request_id` among the attributes becomes `splitserve.request_id`
    (and, with a remote parent, defaults to the one it carries). An exception leaving it marks it failed."""
    tracer = _state.tracer
    if tracer is None:
        return _NULL
    return tracer.start_as_current_span(
        name, context=_context(parent), kind=_kind(kind), attributes=_attributes(attributes, parent)
    )


def start(name: str, parent: TraceContext | None = None, *, kind: str = "internal", **attributes) -> Any:
    """A span to end later with `end()` (None when off); unlike `span()`, it does not become current."""
    tracer = _state.tracer
    if tracer is None:
        return None
    return tracer.start_span(
        name, context=_context(parent), kind=_kind(kind), attributes=_attributes(attributes, parent)
    )


def annotate(span_: Any, **attributes) -> None:
    """Adds attributes (named like `span()`'s) to a span; nothing when off."""
    if span_ is not None:
        span_.set_attributes(_attributes(attributes, None))


def end(span_: Any, error: str | None = None, **attributes) -> None:
    """Ends a span from `start()`, failed when `error` says why, with these attributes added."""
    if span_ is None:
        return
    if attributes:
        span_.set_attributes(_attributes(attributes, None))
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span_.set_status(Status(StatusCode.ERROR, error))
    span_.end()


def record(name: str, parent: TraceContext | None, start_ns: int, end_ns: int, **attributes) -> None:
    """A span measured after the fact, from `start_ns` to `end_ns` (time.time_ns())."""
    tracer = _state.tracer
    if tracer is None:
        return
    made = tracer.start_span(
        name, context=_context(parent), start_time=start_ns, attributes=_attributes(attributes, parent)
    )
    made.end(end_time=max(end_ns, start_ns))


def event(span_: Any, name: str, time_ns: int | None = None, **attributes) -> None:
    """A point in a span's time (named attributes like `span()`'s)."""
    if span_ is not None:
        span_.add_event(name, _attributes(attributes, None), timestamp=time_ns)


def fail(span_: Any, error: str) -> None:
    """Marks a span failed without ending it."""
    if span_ is not None:
        from opentelemetry.trace import Status, StatusCode

        span_.set_status(Status(StatusCode.ERROR, error))


def context_of(span_: Any, request_id: str) -> TraceContext | None:
    """The carrier that makes `span_` the parent of spans in another process (None when off or no span)."""
    if span_ is None:
        return None
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers, context=set_span_in_context(span_))
    return TraceContext(headers["traceparent"], request_id, headers.get("tracestate", ""))


@contextlib.contextmanager
def remote_parent(headers: Mapping[str, str]) -> Iterator[None]:
    """Within it, spans started without a parent continue the trace of the W3C `traceparent` in `headers`
    (an HTTP request's or gRPC call's); nothing happens when off or without one."""
    if _state.tracer is None or "traceparent" not in headers:
        yield
        return
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    token = context.attach(TraceContextTextMapPropagator().extract(dict(headers)))
    try:
        yield
    finally:
        context.detach(token)


def _context(parent: TraceContext | None):
    if parent is None:
        return None  # the current context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": parent.traceparent}
    if parent.tracestate:
        carrier["tracestate"] = parent.tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def _kind(kind: str):
    from opentelemetry.trace import SpanKind

    return {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}[kind]


def _attributes(attributes: dict[str, Any], parent: TraceContext | None) -> dict[str, Any]:
    named = {(REQUEST_ID if key == "request_id" else f"splitserve.{key}"): value for key, value in attributes.items()}
    if parent is not None:
        named.setdefault(REQUEST_ID, parent.request_id)
    return {key: value for key, value in named.items() if value is not None}
