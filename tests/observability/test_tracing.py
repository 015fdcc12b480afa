"""Traces through a real cluster to a real OTLP/gRPC receiver: a request's spans on the router, the prefill
worker and the decode instance form one trace, each linked to its parent across the Ray calls, continuing the
caller's W3C `traceparent`, with the request id on every span; a migrated request's second attempt is a
second `splitserve.attempt` with its own prefill and decode spans. (Cluster: tests/observability/conftest.py.)"""
from __future__ import annotations

import contextlib
import signal
import threading
import time

import openai
import ray

from common.metric_identity import served_model_name
from splitserve_client.client import Client
from tests.factories import TinySpec

CALLER_TRACE, CALLER_SPAN = "ab" * 16, "cd" * 8  # a caller's W3C trace and span ids
ROUTER_SPANS = {"splitserve.request", "splitserve.attempt", "splitserve.route", "splitserve.admission"}
PREFILL_SPANS = {"splitserve.prefill", "splitserve.queue", "splitserve.prefill.compute", "splitserve.handoff"}
ATTEMPT_SPANS = ROUTER_SPANS | PREFILL_SPANS | {"splitserve.decode"}


def _one(spans, name: str, **attributes):
    (found,) = [s for s in spans if s.name == name and all(s.attributes.get(f"splitserve.{k}") == v
                                                           for k, v in attributes.items())]
    return found


def _check_attempt(spans, attempt, by_id) -> None:
    """The prefill worker's and decode instance's spans of one attempt hang under it, as the hand-off goes."""
    prefill = [s for s in spans if s.name == "splitserve.prefill" and s.parent_span_id == attempt.span_id]
    assert len(prefill) == 1, [(s.name, s.parent_span_id) for s in spans]
    prefill = prefill[0]
    assert prefill.service == "splitserve-prefill"
    for name in ("splitserve.queue", "splitserve.prefill.compute", "splitserve.handoff"):
        assert [s.name for s in spans if s.parent_span_id == prefill.span_id].count(name) == 1, name
    handoff = next(s for s in spans if s.name == "splitserve.handoff" and s.parent_span_id == prefill.span_id)
    compute = next(s for s in spans if s.name == "splitserve.prefill.compute" and s.parent_span_id == prefill.span_id)
    assert compute.attributes["splitserve.chunks"] >= 1 and sum(compute.attributes["splitserve.chunk_tokens"]) > 0
    decode = [s for s in spans if s.name == "splitserve.decode" and s.parent_span_id == handoff.span_id]
    assert len(decode) == 1 and decode[0].service == "splitserve-decode"
    assert by_id[attempt.parent_span_id].name == "splitserve.request"


def test_one_trace_across_router_prefill_and_decode(stack, otlp_receiver, checkpoint):
    request_id = "traced-1-0"  # the router's id of the request's first choice: its X-Request-Id, "-0"
    model = served_model_name(checkpoint(TinySpec()))
    with openai.OpenAI(base_url=f"{stack.server.http.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        response = client.completions.create(
            model=model, prompt="trace me through the cluster", max_tokens=5, extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": "traced-1", "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    assert response.usage.completion_tokens == 5
    spans = otlp_receiver.wait_for(request_id, ATTEMPT_SPANS)
    assert {s.trace_id for s in spans} == {CALLER_TRACE}, "the caller's trace continues"
    by_id = {s.span_id: s for s in spans}
    root = _one(spans, "splitserve.request")
    assert root.parent_span_id == CALLER_SPAN and root.service == "splitserve-router"
    assert root.attributes["splitserve.output_tokens"] == 5 and root.status_code != 2
    attempt = _one(spans, "splitserve.attempt")
    assert attempt.parent_span_id == root.span_id
    for name in ("splitserve.route", "splitserve.admission"):
        assert _one(spans, name).parent_span_id == attempt.span_id
    _check_attempt(spans, attempt, by_id)
    for span in spans:  # nested in time as in the tree
        parent = by_id.get(span.parent_span_id)
        if parent is not None:
            assert parent.start_ns <= span.start_ns + 1_000_000, (parent.name, span.name)  # clocks of one host


def test_a_migrated_request_traces_its_second_attempt(stack, otlp_receiver):
    """Its decode instance is killed mid-stream: the request resumes on the other one, in the same trace."""
    members = stack.server.service.cluster.membership.decode
    assert len(members) == 2
    for member in members:  # slow steps, so that the kill lands mid-stream (the tiny model is fast)
        ray.get(member.actor.debug_set_step_delay.remote(0.05), timeout=10)
    request_id, tokens, finals, errors, route = "traced-migrated", [], [], [], []

    def stream() -> None:
        try:
            with Client(stack.target) as client:
                for chunk in client.generate_stream("a request that moves", request_id=request_id, max_tokens=40,
                                                    ignore_eos=True, temperature=0.0):
                    tokens.extend(chunk.token_ids)
                    if chunk.route and not route:
                        route.append(chunk.route)
                    if chunk.finish_reason:
                        finals.append(chunk)
        except Exception as err:  # noqa: BLE001 - asserted on below
            errors.append(err)

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(tokens) < 4:
        assert time.monotonic() < deadline and not errors, (tokens, errors)
        time.sleep(0.02)
    victim = next(m for m in members if m.worker_id == route[0].decode_instance)
    with contextlib.suppress(ray.exceptions.RayActorError):  # it dies answering
        ray.get(victim.actor.debug_signal.remote(signal.SIGKILL), timeout=10)
    thread.join(90)
    assert not thread.is_alive() and errors == [] and len(tokens) == 40 and finals[0].migrations == 1
    spans = otlp_receiver.wait_for(request_id, {"splitserve.request"} | {"splitserve.decode"})
    deadline = time.monotonic() + 20  # the second attempt's decode span: its instance survived
    while len([s for s in spans if s.name == "splitserve.attempt"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        spans = otlp_receiver.of_request(request_id)
    by_id = {s.span_id: s for s in spans}
    assert len({s.trace_id for s in spans}) == 1
    root = _one(spans, "splitserve.request")
    assert root.attributes["splitserve.migrations"] == 1
    first, second = _one(spans, "splitserve.attempt", attempt=0), _one(spans, "splitserve.attempt", attempt=1)
    assert first.parent_span_id == second.parent_span_id == root.span_id
    assert first.status_code == 2 and first.status_message == "migrated" and "migrate" in first.events
    assert second.attributes["splitserve.resumed_tokens"] >= 4 and second.status_code != 2
    _check_attempt(spans, second, by_id)
