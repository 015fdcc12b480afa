"""Tracing off costs nothing: no span, no context on messages. (Traces from a real cluster to a real OTLP
receiver: tests/observability/test_tracing.py.)"""
from __future__ import annotations


def test_tracing_off_makes_nothing():
    """Off (no endpoint), the hot paths get a shared no-op and messages carry no trace context."""
    from common import tracing
    from common.messages import GenerateRequest
    from engine import SamplingParams

    assert not tracing.enabled()
    assert tracing.span("x", None, request_id="r") is tracing.span("y")  # one shared no-op context manager
    assert tracing.start("x") is None and tracing.context_of(None, "r") is None
    with tracing.remote_parent({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}):
        assert tracing.start("x") is None
    assert GenerateRequest("r", (1, 2), SamplingParams()).trace_context is None
