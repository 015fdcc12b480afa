"""The router's Prometheus metrics, read back the way Prometheus reads them: through the real HTTP
exporter on loopback, parsed with prometheus_client's own parser, with exact values.

One exporter serves the whole module (stopping one takes up to half a second); each test mounts its
own fresh `RouterMetrics` registry on it, so values start from zero in every test.
"""
from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.metrics_http import scrape
from router.metrics import (OUTCOMES, REJECT_REASONS, RouterMetrics, outcome_label, priority_class,
                            reject_reason, slo_met)

P = "splitserve_router_"


@pytest.fixture
def metrics(metrics_exporter):
    """A fresh RouterMetrics, served by the module's exporter for the length of one test."""
    mount, server = metrics_exporter
    fresh = RouterMetrics()
    mount.register(fresh.registry)
    fresh.url = server.url
    yield fresh
    mount.unregister(fresh.registry)


def read(metrics: RouterMetrics) -> dict:
    return scrape(metrics.url)


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def test_latency_histograms_by_priority_class(metrics):
    metrics.observe_ttft(0.2, priority=5)
    metrics.observe_ttft(3.0, priority=5)
    metrics.observe_ttft(0.004, priority=-1)
    metrics.observe_tpot(0.02)
    metrics.observe_request("ok", duration_s=12.0, priority=0)
    s = read(metrics)
    assert value(s, P + "ttft_seconds_count", priority="high") == 2
    assert value(s, P + "ttft_seconds_sum", priority="high") == pytest.approx(3.2)
    assert value(s, P + "ttft_seconds_bucket", priority="high", le="0.25") == 1
    assert value(s, P + "ttft_seconds_bucket", priority="high", le="5.0") == 2
    assert value(s, P + "ttft_seconds_bucket", priority="low", le="0.005") == 1
    assert value(s, P + "tpot_seconds_bucket", priority="normal", le="0.01") == 0
    assert value(s, P + "tpot_seconds_bucket", priority="normal", le="0.02") == 1
    assert value(s, P + "request_duration_seconds_bucket", priority="normal", le="10.0") == 0
    assert value(s, P + "request_duration_seconds_bucket", priority="normal", le="20.0") == 1
    assert value(s, P + "request_duration_seconds_bucket", priority="normal", le="+Inf") == 1


@pytest.mark.parametrize("name, smallest_s, largest_s", [
    ("ttft_seconds", 0.005, 300.0), ("tpot_seconds", 0.001, 5.0), ("request_duration_seconds", 0.05, 1800.0)])
def test_buckets_span_milliseconds_to_minutes(metrics, name, smallest_s, largest_s):
    metrics.observe_ttft(1.0)
    metrics.observe_tpot(1.0)
    metrics.observe_request("ok", duration_s=1.0)
    bounds = {dict(labels)["le"] for sample, labels in read(metrics) if sample == P + name + "_bucket"}
    assert "+Inf" in bounds
    finite = sorted(float(b) for b in bounds - {"+Inf"})
    assert (finite[0], finite[-1]) == (smallest_s, largest_s)


def test_requests_by_outcome_and_goodput(metrics):
    metrics.observe_request("ok", met_slo=True, duration_s=1.0)
    metrics.observe_request("ok", met_slo=True)
    metrics.observe_request("ok", met_slo=False, duration_s=2.0)
    metrics.observe_request("UNAVAILABLE", met_slo=True)  # failed: never goodput, whatever the flag
    metrics.observe_request("resource_exhausted")
    metrics.observe_request("no such status")
    s = read(metrics)
    assert value(s, P + "requests_total", outcome="ok") == 3
    assert value(s, P + "requests_total", outcome="unavailable") == 1
    assert value(s, P + "requests_total", outcome="resource_exhausted") == 1
    assert value(s, P + "requests_total", outcome="unknown") == 1
    assert value(s, P + "goodput_requests_total") == 2
    assert value(s, P + "request_duration_seconds_count", priority="normal") == 2
    assert value(s, P + "request_duration_seconds_sum", priority="normal") == 3.0


def test_admissions_and_rejections_by_reason(metrics):
    metrics.admitted()
    metrics.admitted()
    assert metrics.rejected("ttft_slo") == "ttft_slo"
    assert metrics.rejected("the router is serving its limit of 1024 requests") == "concurrency"
    assert metrics.rejected("not enough free KV blocks on any decode instance") == "kv_capacity"
    assert metrics.rejected("the moon is in the wrong phase") == "other"
    s = read(metrics)
    assert value(s, P + "admitted_requests_total") == 2
    for reason in ("ttft_slo", "concurrency", "kv_capacity", "other"):
        assert value(s, P + "rejected_requests_total", reason=reason) == 1
    assert value(s, P + "rejected_requests_total", reason="tpot_slo") == 0  # exported from the start


@pytest.mark.parametrize("text, label", [
    ("queue_limit", "queue_limit"), (" TPOT_SLO ", "tpot_slo"),
    ("estimated TTFT 900 ms exceeds the 500 ms SLO", "ttft_slo"),
    ("estimated time per output token exceeds the SLO", "tpot_slo"),
    ("prefill queue is full (256 waiting)", "queue_limit"),
    ("decode pool out of memory", "kv_capacity"),
    ("too many concurrent requests", "concurrency"),
    ("", "other"),
])
def test_reject_reason_maps_free_text_to_a_fixed_set(text, label):
    assert reject_reason(text) == label
    assert label in REJECT_REASONS


def test_outcome_and_priority_labels_are_bounded():
    assert outcome_label("DEADLINE_EXCEEDED") == "deadline_exceeded"
    assert outcome_label("request 42 broke") == "unknown"
    assert {"ok", "invalid_argument", "unavailable", "deadline_exceeded", "resource_exhausted"} <= set(OUTCOMES)
    assert [priority_class(p) for p in (1000, 1, 0, -1, -1000)] == ["high", "high", "normal", "low", "low"]


def test_slo_met():
    assert slo_met(0.5, 0.05, None, None)
    assert slo_met(0.5, 0.05, 500.0, 50.0)
    assert not slo_met(0.501, 0.05, 500.0, None)
    assert not slo_met(0.1, 0.051, None, 50.0)
    assert slo_met(0.1, None, 500.0, 50.0)  # one token: no TPOT to judge


def test_inflight_gauge_set_or_tracked(metrics):
    metrics.set_inflight(3)
    assert value(read(metrics), P + "inflight_requests") == 3
    box = [7]
    metrics.track_inflight(lambda: box[0])
    assert value(read(metrics), P + "inflight_requests") == 7
    box[0] = 0
    assert value(read(metrics), P + "inflight_requests") == 0


def test_prompt_and_cached_prompt_tokens(metrics):
    metrics.prompt_tokens(100, 64)
    metrics.prompt_tokens(10, 0)
    with pytest.raises(ValueError, match="cached prompt tokens 11"):
        metrics.prompt_tokens(10, 11)
    s = read(metrics)
    assert value(s, P + "prompt_tokens_total") == 110
    assert value(s, P + "cached_prompt_tokens_total") == 64


def test_worker_load_gauges_and_forgetting_a_worker(metrics):
    metrics.set_worker_load("prefill-0", "prefill", waiting=4, running=2, kv_usage=0.25)
    metrics.set_worker_load("decode-0", "decode", waiting=0, running=9, kv_usage=0.75, healthy=False)
    s = read(metrics)
    assert value(s, P + "worker_waiting_requests", worker="prefill-0", role="prefill") == 4
    assert value(s, P + "worker_running_requests", worker="prefill-0", role="prefill") == 2
    assert value(s, P + "worker_kv_usage_ratio", worker="decode-0", role="decode") == 0.75
    assert value(s, P + "worker_healthy", worker="prefill-0", role="prefill") == 1
    assert value(s, P + "worker_healthy", worker="decode-0", role="decode") == 0
    metrics.forget_worker("decode-0", "decode")
    metrics.forget_worker("decode-0", "decode")  # twice: harmless
    s = read(metrics)
    assert not any(("worker", "decode-0") in labels for _, labels in s)
    assert value(s, P + "worker_running_requests", worker="prefill-0", role="prefill") == 2


def test_snapshot_shows_the_scraped_figures(metrics):
    empty = metrics.snapshot()
    assert empty["requests_total"] == {} and empty["goodput_requests_total"] == 0 and empty["workers"] == {}
    metrics.observe_ttft(0.5, 1)
    metrics.observe_request("ok", met_slo=True, duration_s=2.0, priority=1)
    metrics.observe_request("unavailable")
    metrics.admitted()
    metrics.rejected("kv_capacity")
    metrics.set_inflight(2)
    metrics.prompt_tokens(48, 32)
    metrics.set_worker_load("prefill-0", "prefill", 1, 2, 0.5)
    snap, s = metrics.snapshot(), read(metrics)
    assert snap["requests_total"] == {"ok": 1, "unavailable": 1}
    assert snap["requests_total"]["ok"] == value(s, P + "requests_total", outcome="ok")
    assert snap["goodput_requests_total"] == 1 and snap["admitted_requests_total"] == 1
    assert {reason: n for reason, n in snap["rejected_requests_total"].items() if n} == {"kv_capacity": 1}
    assert snap["inflight_requests"] == 2
    assert (snap["prompt_tokens_total"], snap["cached_prompt_tokens_total"]) == (48, 32)
    assert snap["ttft_seconds"] == {"high": {"count": 1, "sum": 0.5}}
    assert snap["request_duration_seconds"] == {"high": {"count": 1, "sum": 2.0}}
    assert snap["tpot_seconds"] == {}
    assert snap["workers"] == {"prefill-0": {"role": "prefill", "waiting": 1, "running": 2, "kv_usage": 0.5,
                                             "healthy": 1}}


def test_names_and_labels_follow_prometheus_conventions(metrics):
    metrics.observe_ttft(0.1, 1)
    metrics.observe_tpot(0.1, 1)
    metrics.observe_request("ok", met_slo=True, duration_s=1.0)
    metrics.rejected("queue_limit")
    metrics.set_worker_load("w", "prefill", 0, 0, 0.0)
    with urllib.request.urlopen(metrics.url, timeout=5) as response:
        text = response.read().decode()
    # the 0.0.4 text format shows each counter's / histogram's creation time as a `_created` gauge
    families = [f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")]
    assert {f.name: f.type for f in families} == {
        P + "ttft_seconds": "histogram", P + "tpot_seconds": "histogram",
        P + "request_duration_seconds": "histogram", P + "requests": "counter", P + "goodput_requests": "counter",
        P + "admitted_requests": "counter", P + "rejected_requests": "counter", P + "inflight_requests": "gauge",
        P + "migrations": "counter",
        P + "prompt_tokens": "counter", P + "cached_prompt_tokens": "counter",
        P + "worker_waiting_requests": "gauge", P + "worker_running_requests": "gauge",
        P + "worker_kv_usage_ratio": "gauge", P + "worker_healthy": "gauge", P + "worker_epoch": "gauge",
        P + "inter_token_latency_seconds": "histogram", P + "generation_tokens": "counter",
        P + "request_prompt_tokens": "histogram", P + "request_generation_tokens": "histogram",
        P + "slo_requests": "counter", P + "controller_outages": "counter",
        "splitserve_build_info": "gauge"}  # counters: family name drops _total
    for family in families:
        assert family.name.startswith(P) or family.name == "splitserve_build_info", family.name
        assert family.documentation, family.name
        for sample in family.samples:
            if family.name == "splitserve_build_info":
                assert set(sample.labels) == {"version", "python_version", "component"} and sample.value == 1
                continue
            assert set(sample.labels) <= {"priority", "outcome", "reason", "worker", "role", "le", "cause", "slo",
                                         "result"}, sample
            if family.type == "counter" and not sample.name.endswith("_created"):
                assert sample.name.endswith("_total"), sample.name
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_tokens")), family.name
        if family.type != "counter":
            assert not family.name.endswith("_total"), family.name

