"""Each admission policy's exact decisions, and the priority-shedding order under rising load."""
from __future__ import annotations

import dataclasses

import pytest

from policies.admission import AdmissionConfig, Cause, PredictivePolicy, ThresholdPolicy, make_admission_policy
from policies.admission.cost_model import DecodeStepFit, ObservedTtftFit, PrefillTimeFit, TransferTimeFit
from policies.admission.predictor import predict
from policies.admission.view import AdmissionRequest, ClusterView, DecodeInstanceView, RunningRequest
from policies.routing.base import WorkerLoad

PREFILL = PrefillTimeFit(0.01, 1e-4, 0.0)
DECODE = DecodeStepFit(0.01, 0.001, 1e-6)
TRANSFER = TransferTimeFit(0.002, 1e-9)
RUNNING = (RunningRequest(8, 10, 100), RunningRequest(0, 50, 200), RunningRequest(5, 100, 300))
A_DONE_S = 2 * 0.0136  # the first of RUNNING finishes; the next steps take 12.504 ms
# Headroom: priority 2 → 1.0, 1 → 0.8, 0 → 0.6; budgets are SLO × 0.8 × headroom.
CONFIG = AdmissionConfig(default_ttft_ms=500, default_tpot_ms=100, slo_margin=0.8, full_budget_priority=2,
                         shed_step_per_priority=0.2, max_queued_prompt_tokens=1000, max_running_requests=4,
                         max_kv_usage=0.5, min_retry_after_s=0.001)


def request(prompt=300, priority=2, ttft_ms=None, tpot_ms=None) -> AdmissionRequest:
    return AdmissionRequest(prompt, 0, 16, ttft_ms, tpot_ms, priority)


def view(queued=0, running=RUNNING, free=190, total=200) -> ClusterView:
    return ClusterView((WorkerLoad("p0", 1, queued),), (DecodeInstanceView("d0", running, free, total),),
                       PREFILL, DECODE, TRANSFER, kv_bytes_per_token=1000, block_size_tokens=16,
                       prefill_step_budget_tokens=512)


def test_threshold_queued_tokens_limit_scales_with_priority():
    policy = ThresholdPolicy(CONFIG)
    assert policy.decide(request(priority=2), view(queued=999)).admit  # the request's own 300 do not count
    got = policy.decide(request(priority=2), view(queued=1100))
    assert (got.admit, got.cause) == (False, Cause.QUEUED_TOKENS)
    assert got.retry_after_s == pytest.approx(0.01 + 101 * 1e-4, abs=1e-12)  # drain to below the limit
    assert got.reason == ("the least-loaded prefill worker p0 already has 1100 uncached prompt tokens queued; "
                          "the limit for priority 2 is 1000 (100% of the configured limit)")
    assert [policy.decide(request(priority=p), view(queued=q, running=())).admit
            for p, q in ((1, 799), (1, 800), (0, 599), (0, 600))] == [True, False, True, False]


def test_threshold_running_kv_usage_and_kv_blocks_limits():
    policy = ThresholdPolicy(CONFIG)
    assert policy.decide(request(priority=1), view()).admit  # 3 running < 4 × 0.8
    got = policy.decide(request(priority=0), view())  # 3 running ≥ 4 × 0.6
    assert (got.admit, got.cause) == (False, Cause.RUNNING_REQUESTS)
    assert got.retry_after_s == pytest.approx(A_DONE_S, abs=1e-12)
    assert got.reason == ("every decode instance with room already runs 3 or more sequences; the limit for "
                          "priority 0 is 2.4 (60% of the configured limit)")
    full = policy.decide(request(priority=2), view(running=(), free=50, total=100))  # 50% in use ≥ 50%
    assert (full.admit, full.cause, full.retry_after_s) == (False, Cause.KV_USAGE, CONFIG.retry_after_s)
    assert "already has 50% or more of its KV blocks in use; the limit for priority 2 is 50%" in full.reason
    assert policy.decide(request(priority=2), view(running=(), free=51, total=100)).admit
    none_free = policy.decide(request(priority=2), view(free=18))  # 300 + 1 tokens need 19 blocks
    assert (none_free.admit, none_free.cause) == (False, Cause.KV_BLOCKS)


def test_predictive_judges_ttft_on_the_observed_model_where_the_steps_run_short():
    # Steps: 1300 tokens = 3 steps, 160 ms, within the 400 ms budget. Observed: 40 + 1300 × 0.3 = 430 ms.
    assert PredictivePolicy(CONFIG).decide(request(), view(queued=1000)).admit
    observed = dataclasses.replace(view(queued=1000), ttft_fit=ObservedTtftFit(0.04, 3e-4))
    got = PredictivePolicy(CONFIG).decide(request(), observed)
    assert (got.admit, got.cause) == (False, Cause.TTFT)
    # Alone (the steps): 40 ms, also its own share of the steps; the other 390 ms is waiting.
    assert got.reason == ("predicted TTFT 430 ms (390 ms of it waiting behind the prefill queued on p0) exceeds "
                          "the 400 ms allowed for priority 2: 40.0 ms alone + 100% of the room up to the budget of "
                          "400 ms (SLO 500 ms × margin 0.8)")
    assert got.retry_after_s == pytest.approx(0.03, abs=1e-12)


def test_an_idle_worker_is_judged_on_the_steps_so_a_stale_observed_model_cannot_reject_everything():
    stale = ObservedTtftFit(0.5, 0.0)  # fitted during an overload: 500 ms for anything, over the 400 ms budget
    got = PredictivePolicy(CONFIG).decide(request(), dataclasses.replace(view(), ttft_fit=stale))
    assert got.admit and got.prediction.ttft_s == pytest.approx(0.04, abs=1e-12)
    queued = PredictivePolicy(CONFIG).decide(request(), dataclasses.replace(view(queued=16), ttft_fit=stale))
    assert (queued.admit, queued.cause) == (False, Cause.TTFT)


def test_predictive_ttft_rejection_reason_and_wait():
    got = PredictivePolicy(CONFIG).decide(request(priority=2), view(queued=4000))
    # 4300 tokens = 9 steps: 520 ms; the queue alone 8 steps: 480 ms. Budget 500 × 0.8 = 400 ms.
    assert (got.admit, got.cause) == (False, Cause.TTFT)
    assert got.reason == ("predicted TTFT 520 ms (480 ms of it waiting behind the prefill queued on p0) exceeds "
                          "the 400 ms allowed for priority 2: 40.0 ms alone + 100% of the room up to the budget of "
                          "400 ms (SLO 500 ms × margin 0.8)")
    assert got.retry_after_s == pytest.approx(0.12, abs=1e-12)
    assert got.prediction is None


def test_predictive_counts_the_time_a_request_waited_before_the_router():
    # 1300 tokens through the queue: 160 ms of steps (120 ms of it queued); the budget is 400 ms.
    assert PredictivePolicy(CONFIG).decide(dataclasses.replace(request(), waited_s=0.2), view(queued=1000)).admit
    got = PredictivePolicy(CONFIG).decide(dataclasses.replace(request(), waited_s=0.25), view(queued=1000))
    assert (got.admit, got.cause) == (False, Cause.TTFT)
    assert got.reason == ("predicted TTFT 410 ms (250 ms of it spent before reaching the router, 120 ms waiting "
                          "behind the prefill queued on p0) exceeds the 400 ms allowed for priority 2: 40.0 ms alone "
                          "+ 100% of the room up to the budget of 400 ms (SLO 500 ms × margin 0.8)")
    # A retry is a new send: without this one's 250 ms it would fit now, so the floor.
    assert got.retry_after_s == CONFIG.min_retry_after_s


def test_predictive_lower_priority_gets_a_smaller_share_of_the_room_for_load():
    policy = PredictivePolicy(CONFIG)
    # 2300 tokens = 5 steps: 280 ms. Allowed: 40 + 0.8 × 360 = 328 ms for priority 1, 40 + 0.6 × 360 = 256 for 0.
    assert policy.decide(request(priority=1), view(queued=2000)).admit
    got = policy.decide(request(priority=0), view(queued=2000))
    assert (got.admit, got.cause) == (False, Cause.TTFT)
    assert got.retry_after_s == pytest.approx(0.28 - 0.256, abs=1e-12)


def test_predictive_rejects_for_good_what_no_wait_can_fix():
    got = PredictivePolicy(CONFIG).decide(request(priority=2, ttft_ms=20), view())
    assert (got.admit, got.cause, got.retry_after_s) == (False, Cause.TTFT, None)
    assert got.reason.startswith("its 300 uncached prompt tokens alone take a predicted 40.0 ms to prefill")


def test_predictive_tpot_rejection_waits_for_the_batch_to_shrink_by_the_join():
    # Prompt 400: TTFT 50 ms, transfer 2.4 ms, joins at 52.4 ms into a batch of 3 → 13.909 ms per step.
    # Budget 16.25 × 0.8 = 13 ms: met once B finishes too (C + newcomer: 12.751 ms), at 627.392 ms.
    got = PredictivePolicy(CONFIG).decide(request(prompt=400, priority=2, tpot_ms=16.25), view())
    assert (got.admit, got.cause) == (False, Cause.TPOT)
    assert got.prediction.tpot_s == pytest.approx(0.013909, abs=1e-12)
    assert got.retry_after_s == pytest.approx(A_DONE_S + 48 * 0.012504 - 0.0524, abs=1e-12)
    assert got.reason.startswith("predicted TPOT 13.9 ms (decode batch of 3 when it joins d0) exceeds the 13.0 ms "
                                 "allowed for priority 2: 11.4 ms alone + 100% of the room")
    # Priority 1 may add 80% of 13 − 11.401 ms to the 11.401 ms alone: 12.6802 ms, met once C is alone too.
    low = PredictivePolicy(CONFIG).decide(request(prompt=400, priority=1, tpot_ms=16.25), view())
    after_c_s = A_DONE_S + 48 * 0.012504 + 45 * (0.01 + 0.001 + 350e-6)
    assert low.retry_after_s == pytest.approx(after_c_s - 0.0524, abs=1e-12)


def test_predictive_kv_rejection_waits_for_blocks():
    # 26 blocks needed, 25 free; once the first sequence leaves, 32 are.
    got = PredictivePolicy(CONFIG).decide(request(prompt=400, priority=2), view(free=25))
    assert (got.admit, got.cause) == (False, Cause.KV_BLOCKS)
    assert got.retry_after_s == pytest.approx(A_DONE_S, abs=1e-12)
    assert got.reason == "no decode instance has the 26 free KV blocks the request needs"


def test_predictive_admits_with_the_prediction():
    got = PredictivePolicy(CONFIG).decide(request(prompt=400, priority=2), view())
    assert (got.admit, got.cause, got.retry_after_s) == (True, Cause.ADMITTED, None)
    assert got.prediction == predict(request(prompt=400, priority=2), view())
    assert got.reason == "predicted TTFT 50.0 ms and TPOT 13.9 ms are within budget"


def test_own_slo_overrides_the_priority_default():
    config = AdmissionConfig.from_dict({"priority_slos": {2: {"ttft_ms": 100, "tpot_ms": 100}}})
    policy = PredictivePolicy(config)
    assert policy.slo(request(priority=2)) == (100, 100)
    assert policy.slo(request(priority=2, ttft_ms=300)) == (300, 100)
    assert policy.slo(request(priority=7)) == (config.default_ttft_ms, config.default_tpot_ms)


def first_rejected_load(policy, priority: int, views) -> int:
    """Index of the first view that rejects `priority`; asserts that no later (heavier) view admits it."""
    admits = [policy.decide(request(priority=priority), v).admit for v in views]
    first = admits.index(False)
    assert not any(admits[first:]), f"priority {priority} admitted again under more load"
    return first


@pytest.mark.parametrize("name", ["threshold", "predictive"])
def test_rising_prefill_queue_sheds_priority_0_then_1_then_2(name):
    policy = make_admission_policy(name, config=CONFIG)
    views = [view(queued=q, running=()) for q in range(0, 20_000, 50)]
    order = [first_rejected_load(policy, p, views) for p in (0, 1, 2)]
    assert order[0] < order[1] < order[2]


@pytest.mark.parametrize("name", ["threshold", "predictive"])
def test_rising_decode_batch_sheds_priority_0_then_1_then_2(name):
    config = dataclasses.replace(CONFIG, max_running_requests=40)
    policy = make_admission_policy(name, config=config)
    views = [view(running=tuple(RunningRequest(0, 1000, 500) for _ in range(n)), free=200) for n in range(60)]
    order = [first_rejected_load(policy, p, views) for p in (0, 1, 2)]
    assert order[0] < order[1] < order[2]


def test_priorities_at_or_above_the_full_budget_one_are_treated_alike():
    policy = ThresholdPolicy(CONFIG)
    for queued in (700, 701):
        top, higher = (policy.decide(request(priority=p), view(queued)) for p in (2, 50))
        assert (top.admit, top.cause, top.retry_after_s) == (higher.admit, higher.cause, higher.retry_after_s)
