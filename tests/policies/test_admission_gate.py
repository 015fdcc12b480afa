"""The router's admission gate: the observed-TTFT model it fits from its own admitted requests, and the
view it hands the policy (exact numbers; no cluster)."""
from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from policies.admission import AdmissionConfig, Cause, ObservedTtftFit
from policies.admission.gate import AdmissionGate
from policies.routing.base import WorkerLoad
from router.validation import RouterRequest

def gate() -> AdmissionGate:
    # Default priors elsewhere: prefill steps of 10 ms + 0.1 ms per token, 512 tokens at most.
    config = AdmissionConfig(policy="predictive", default_ttft_ms=500.0, cost_min_samples=2)
    return AdmissionGate(config, kv_bytes_per_token=1000, block_size=16, prefill_step_budget_tokens=512)


def routed(num_prompt_tokens: int = 300) -> RouterRequest:
    return RouterRequest("r1", tuple(range(5, 5 + num_prompt_tokens)), SamplingParams(max_tokens=4), 0, "t",
                         None, None, False, None)


def decide(g: AdmissionGate, queued_tokens: int):
    return g.decide(routed(), 0, WorkerLoad("p0", 3, queued_tokens), "d0", [], 100, 100)


def test_observed_ttfts_fit_the_gates_model():
    g = gate()
    for tokens_through, ttft_s in ((440, 0.128), (880, 0.216), (4400, 0.92)):
        g.observe_ttft(tokens_through, ttft_s)
    fit = g.ttft_cost.fit()
    assert fit == pytest.approx(ObservedTtftFit(0.04, 2e-4), rel=1e-9)


def test_the_gate_admits_on_the_larger_of_the_step_and_observed_predictions():
    g = gate()
    # Before any sample: steps only. 1300 tokens through the queue = 3 steps, 160 ms.
    assert decide(g, 1000).prediction.ttft_s == pytest.approx(0.16, abs=1e-12)
    for tokens_through, ttft_s in ((440, 0.128), (880, 0.216)):
        g.observe_ttft(tokens_through, ttft_s)
    # Observed: 40 ms + 1300 × 0.2 ms = 300 ms, within 500 ms × 0.9.
    admitted = decide(g, 1000)
    assert admitted.admit and admitted.prediction.ttft_s == pytest.approx(0.30, abs=1e-12)
    # 3300 tokens: the steps say 400 ms, within the budget; observed 700 ms is not.
    assert decide(gate(), 3000).admit
    rejected = decide(g, 3000)
    assert (rejected.admit, rejected.cause) == (False, Cause.TTFT)
    assert rejected.retry_after_s == pytest.approx(0.70 - 0.45, abs=1e-12)


def test_hand_offs_feed_the_transfer_model():
    from kvtransfer.session import HandoffStats

    g = gate()
    for num_bytes in (1_000_000, 2_000_000, 4_000_000):
        g.observe_handoff(HandoffStats(num_bytes, 0.002 + num_bytes * 1e-9))
    assert g.transfer_cost.num_samples == 3
    assert g.transfer_cost.fit().time_s(3_000_000) == pytest.approx(0.005, rel=1e-6)


def test_decide_request_takes_an_admission_request_as_decide_builds_it():
    from policies.admission import AdmissionRequest

    g = gate()
    for tokens_through, ttft_s in ((440, 0.128), (880, 0.216)):
        g.observe_ttft(tokens_through, ttft_s)
    built = AdmissionRequest(300, 0, 4, None, None, 0)
    for queued in (1000, 3000):
        direct = g.decide_request(built, WorkerLoad("p0", 3, queued), "d0", [], 100, 100)
        assert direct == decide(g, queued)
