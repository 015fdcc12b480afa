"""A worker's Prometheus metrics and the exporter that serves them, read back through real HTTP on
loopback and prometheus_client's own parser, with exact values.

One exporter serves the module's worker-metric tests (stopping one takes up to half a second); each
test mounts a fresh `WorkerMetrics` registry on it. The exporter's own tests start their own.
"""
from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from common.metrics_http import scrape, start_metrics_server
from common.worker_metrics import WorkerMetrics
from engine.speculative.counters import SpecCounters

P = "splitserve_worker_"
PREFILL = {"worker": "prefill-0", "role": "prefill"}
DECODE = {"worker": "decode-1", "role": "decode"}


@pytest.fixture
def serve(metrics_exporter):
    """serve(WorkerMetrics) → a function that scrapes it; unmounted after the test."""
    mount, server = metrics_exporter
    mounted = []

    def mount_one(metrics: WorkerMetrics):
        mount.register(metrics.registry)
        mounted.append(metrics.registry)
        return lambda: scrape(server.url)

    yield mount_one
    for registry in mounted:
        mount.unregister(registry)


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def test_load_gauges_exist_from_the_start_and_follow_updates(serve):
    metrics = WorkerMetrics("prefill-0", "prefill")
    read = serve(metrics)
    assert value(read(), P + "kv_used_blocks", **PREFILL) == 0
    metrics.set_load(waiting=3, running=5, kv_used_blocks=40, kv_capacity_blocks=256)
    metrics.set_load(waiting=2, running=5, kv_used_blocks=48, kv_capacity_blocks=256)
    s = read()
    assert value(s, P + "waiting_requests", **PREFILL) == 2
    assert value(s, P + "running_requests", **PREFILL) == 5
    assert value(s, P + "kv_used_blocks", **PREFILL) == 48
    assert value(s, P + "kv_capacity_blocks", **PREFILL) == 256


def test_prompt_and_prefix_cache_hit_tokens(serve):
    metrics = WorkerMetrics("prefill-0", "prefill")
    read = serve(metrics)
    metrics.observe_prompt(64, 48)
    metrics.observe_prompt(20, 0)
    with pytest.raises(ValueError, match="cached tokens 21"):
        metrics.observe_prompt(20, 21)
    s = read()
    assert value(s, P + "prompt_tokens_total", **PREFILL) == 84
    assert value(s, P + "prefix_cache_hit_tokens_total", **PREFILL) == 48


def test_steps_by_phase(serve):
    metrics = WorkerMetrics("decode-1", "decode")
    read = serve(metrics)
    metrics.observe_step("decode", 0.004, num_tokens=8)
    metrics.observe_step("decode", 0.02, num_tokens=8)
    metrics.observe_step("prefill", 0.3, num_tokens=512)  # a preempted sequence recomputed on decode
    with pytest.raises(ValueError, match="unknown phase 'verify'; known: prefill, decode"):
        metrics.observe_step("verify", 0.1, 1)
    s = read()
    assert value(s, P + "steps_total", phase="decode", **DECODE) == 2
    assert value(s, P + "steps_total", phase="prefill", **DECODE) == 1
    assert value(s, P + "step_tokens_total", phase="decode", **DECODE) == 16
    assert value(s, P + "step_duration_seconds_count", phase="decode", **DECODE) == 2
    assert value(s, P + "step_duration_seconds_sum", phase="decode", **DECODE) == pytest.approx(0.024)
    assert value(s, P + "step_duration_seconds_bucket", phase="decode", le="0.005", **DECODE) == 1
    assert value(s, P + "step_duration_seconds_bucket", phase="decode", le="0.025", **DECODE) == 2
    assert value(s, P + "step_duration_seconds_bucket", phase="prefill", le="0.25", **DECODE) == 0
    assert value(s, P + "step_duration_seconds_bucket", phase="prefill", le="0.5", **DECODE) == 1


def test_kv_transfers_and_handoffs(serve):
    metrics = WorkerMetrics("prefill-0", "prefill")
    read = serve(metrics)
    assert value(read(), P + "handoffs_total", result="failed", **PREFILL) == 0  # present before any failure
    metrics.observe_transfer("send", 1_048_576, 0.002)
    metrics.observe_transfer("send", 4096, 0.0004)
    metrics.handoff_finished("ok")
    metrics.handoff_finished("ok")
    metrics.handoff_finished("failed")
    metrics.handoff_finished("aborted")
    with pytest.raises(ValueError, match="unknown hand-off result"):
        metrics.handoff_finished("maybe")
    with pytest.raises(ValueError, match="unknown direction"):
        metrics.observe_transfer("sideways", 1, 0.1)
    s = read()
    assert value(s, P + "kv_transfer_bytes_total", direction="send", **PREFILL) == 1_052_672
    assert value(s, P + "kv_transfer_duration_seconds_count", direction="send", **PREFILL) == 2
    assert value(s, P + "kv_transfer_duration_seconds_bucket", direction="send", le="0.0005", **PREFILL) == 1
    assert value(s, P + "kv_transfer_duration_seconds_bucket", direction="send", le="0.0025", **PREFILL) == 2
    assert value(s, P + "handoffs_total", result="ok", **PREFILL) == 2
    assert value(s, P + "handoffs_total", result="failed", **PREFILL) == 1
    assert value(s, P + "handoffs_total", result="aborted", **PREFILL) == 1
    assert not any(dict(labels).get("direction") == "recv" for _, labels in s)
    metrics.prefix_pull_finished("pulled", 5)
    metrics.prefix_pull_finished("failed", 0)
    metrics.observe_transfer("pull_in", 4096, 0.002)
    with pytest.raises(ValueError, match="unknown pull result"):
        metrics.prefix_pull_finished("maybe", 1)
    s = read()
    assert value(s, P + "prefix_pulls_total", result="pulled", **PREFILL) == 1
    assert value(s, P + "prefix_pulls_total", result="skipped", **PREFILL) == 0
    assert value(s, P + "prefix_pull_blocks_total", **PREFILL) == 5
    assert value(s, P + "kv_transfer_bytes_total", direction="pull_in", **PREFILL) == 4096


def test_snapshot_shows_the_scraped_figures(serve):
    metrics = WorkerMetrics("decode-1", "decode")
    read = serve(metrics)
    metrics.set_load(1, 4, 10, 100)
    metrics.observe_step("decode", 0.5, 4)
    metrics.observe_transfer("recv", 2048, 0.25)
    metrics.handoff_finished("ok")
    snap, s = metrics.snapshot(), read()
    assert snap == {
        "worker": "decode-1", "role": "decode", "kv_capacity_blocks": 100, "kv_used_blocks": 10,
        "waiting_requests": 1, "running_requests": 4, "prompt_tokens_total": 0, "prefix_cache_hit_tokens_total": 0,
        "request_queue_time_seconds": {"count": 0, "sum": 0.0}, "preemptions_total": 0, "handoffs_in_flight": 0,
        "steps_total": {"decode": 1}, "step_tokens_total": {"decode": 4},
        "step_duration_seconds": {"decode": {"count": 1, "sum": 0.5}},
        "kv_transfer_bytes_total": {"recv": 2048},
        "kv_transfer_duration_seconds": {"recv": {"count": 1, "sum": 0.25}},
        "handoffs_total": {"ok": 1, "failed": 0, "aborted": 0},
        "prefix_pulls_total": {"pulled": 0, "skipped": 0, "failed": 0}, "prefix_pull_blocks_total": 0,
        "spec_draft_tokens_total": 0, "spec_accepted_tokens_total": 0, "spec_verify_steps_total": 0,
        "spec_engine_steps_total": {"on": 0, "off": 0},
        "moe_expert_tokens_total": {}, "moe_load_imbalance": {}}  # a dense model: the MoE series stay empty
    assert snap["kv_transfer_bytes_total"]["recv"] == value(s, P + "kv_transfer_bytes_total", direction="recv",
                                                            **DECODE)


def test_names_and_labels_follow_prometheus_conventions(metrics_exporter, serve):
    metrics = WorkerMetrics("prefill-0", "prefill")
    serve(metrics)
    metrics.observe_step("prefill", 0.1, 16)
    metrics.observe_transfer("send", 16, 0.1)
    with urllib.request.urlopen(metrics_exporter[1].url, timeout=5) as response:
        text = response.read().decode()
    # the 0.0.4 text format shows each counter's / histogram's creation time as a `_created` gauge
    families = {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}
    assert {name: f.type for name, f in families.items()} == {
        P + "kv_capacity_blocks": "gauge", P + "kv_used_blocks": "gauge", P + "waiting_requests": "gauge",
        P + "running_requests": "gauge", P + "prompt_tokens": "counter", P + "prefix_cache_hit_tokens": "counter",
        P + "steps": "counter", P + "step_tokens": "counter", P + "step_duration_seconds": "histogram",
        P + "kv_transfer_bytes": "counter", P + "kv_transfer_duration_seconds": "histogram",
        P + "handoffs": "counter", P + "prefix_pulls": "counter",
        P + "prefix_pull_blocks": "counter", P + "spec_draft_tokens": "counter", P + "spec_accepted_tokens": "counter",
        P + "spec_verify_steps": "counter", P + "spec_engine_steps": "counter",
        P + "request_queue_time_seconds": "histogram", P + "preemptions": "counter", P + "handoffs_in_flight": "gauge",
        P + "moe_expert_tokens": "counter", P + "moe_load_imbalance": "gauge",
        "splitserve_build_info": "gauge"}  # counters: the name drops _total
    for name, family in families.items():
        assert family.documentation, name
        if name == "splitserve_build_info":
            continue
        if "duration" in name:
            assert name.endswith("_seconds"), name
        if "bytes" in name:
            assert name.endswith("_bytes"), name
        for sample in family.samples:
            assert {"worker", "role"} <= set(sample.labels) <= {"worker", "role", "phase", "direction", "result",
                                                                "switch", "expert", "layer", "le"}, sample
            if family.type == "counter" and not sample.name.endswith("_created"):
                assert sample.name.endswith("_total"), sample.name


def test_role_is_checked():
    with pytest.raises(ValueError, match="unknown role 'router'"):
        WorkerMetrics("r", "router")


# ---- the exporter --------------------------------------------------------------------------------
def test_exporter_binds_loopback_on_an_os_chosen_port_and_closes_it_on_stop():
    registry = CollectorRegistry()
    Counter("splitserve_test_events_total", "Events.", registry=registry).inc(3)
    server = start_metrics_server(registry)
    assert server.host == "127.0.0.1" and server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}/metrics"
    assert scrape(server.url)[("splitserve_test_events_total", ())] == 3
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_exporter_refuses_a_taken_port_or_a_bad_one():
    registry = CollectorRegistry()
    with start_metrics_server(registry) as first:
        with pytest.raises(OSError):
            start_metrics_server(registry, port=first.port)
    with pytest.raises(ValueError, match="65536"):
        start_metrics_server(registry, port=65536)


def test_speculation_counters_catch_up_with_the_engine(serve):
    metrics = WorkerMetrics("decode-2", "decode")
    read = serve(metrics)
    metrics.set_speculation(SpecCounters(sequence_steps=4, draft_tokens=12, accepted_tokens=9, steps_on=3,
                                         steps_off=1))
    metrics.set_speculation(SpecCounters(sequence_steps=6, draft_tokens=16, accepted_tokens=10, steps_on=4,
                                         steps_off=5))
    s, labels = read(), {"worker": "decode-2", "role": "decode"}
    assert value(s, P + "spec_draft_tokens_total", **labels) == 16
    assert value(s, P + "spec_accepted_tokens_total", **labels) == 10
    assert value(s, P + "spec_verify_steps_total", **labels) == 6
    assert value(s, P + "spec_engine_steps_total", switch="off", **labels) == 5
    assert metrics.snapshot()["spec_engine_steps_total"] == {"on": 4, "off": 5}
