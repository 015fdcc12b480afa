"""The predictor and the decode projection, on hand-computed numbers."""
from __future__ import annotations

import dataclasses

import pytest

from policies.admission.cost_model import DecodeStepFit, ObservedTtftFit, PrefillTimeFit, TransferTimeFit
from policies.admission.decode_projection import (first_finish_s, project, segments, time_until_blocks_free_s,
                                                time_until_step_within_s)
from policies.admission.predictor import (Prediction, best_decode, best_prefill, drain_time_s, predict, predict_tpot,
                                        predict_ttft, ttft_alone_s)
from policies.admission.view import AdmissionRequest, ClusterView, DecodeInstanceView, RunningRequest
from policies.routing.base import WorkerLoad

PREFILL = PrefillTimeFit(0.01, 1e-4, 0.0)
DECODE = DecodeStepFit(0.01, 0.001, 1e-6)
TRANSFER = TransferTimeFit(0.002, 1e-9)
# Three sequences: A has 2 tokens left, B 50, C 95. Step at batch 3, context 600: 13.6 ms.
RUNNING = (RunningRequest(8, 10, 100), RunningRequest(0, 50, 200), RunningRequest(5, 100, 300))
OBSERVED = ObservedTtftFit(0.04, 1e-4)  # 40 ms around each request, 0.1 ms per queued token
A_DONE_S = 2 * 0.0136  # A's last step ends here; then batch 2, context 504: 12.504 ms per step
SECOND_STEP_S = 0.01 + 0.002 + 504e-6


def request(prompt=300, cached=0, max_tokens=16, priority=0) -> AdmissionRequest:
    return AdmissionRequest(prompt, cached, max_tokens, None, None, priority)


def instance(instance_id="d0", running=RUNNING, free=100, total=200) -> DecodeInstanceView:
    return DecodeInstanceView(instance_id, running, free, total)


def view(workers=(WorkerLoad("p0", 0, 0),), instances=(instance(),), block_size=16, budget=512,
         observed=ObservedTtftFit(0.0, 0.0)) -> ClusterView:
    return ClusterView(tuple(workers), tuple(instances), PREFILL, DECODE, TRANSFER, kv_bytes_per_token=1000,
                       block_size_tokens=block_size, prefill_step_budget_tokens=budget, ttft_fit=observed)


def test_drain_time_counts_budget_sized_steps():
    assert drain_time_s(0, PREFILL, 512) == 0.0
    assert drain_time_s(512, PREFILL, 512) == pytest.approx(0.01 + 0.0512, abs=1e-12)
    assert drain_time_s(1000, PREFILL, 512) == pytest.approx(2 * 0.01 + 0.1, abs=1e-12)


def test_ttft_is_queue_plus_own_prefill_and_transfer_follows():
    got = predict_ttft(request(prompt=300, cached=100), WorkerLoad("p0", 3, 1000), view())
    # queue: 1000 tokens = 2 steps → 120 ms; with the 200 uncached: 1200 tokens = 3 steps → 150 ms.
    assert got.worker_id == "p0"
    assert got.queue_s == pytest.approx(0.12, abs=1e-12)
    assert got.prefill_s == pytest.approx(0.03, abs=1e-12)
    assert got.ttft_s == pytest.approx(0.15, abs=1e-12)
    assert got.transfer_s == pytest.approx(0.002 + 300 * 1000 * 1e-9, abs=1e-12)  # the whole prompt's KV moves
    assert got.join_s == pytest.approx(0.1523, abs=1e-12)


def test_ttft_is_the_observed_model_where_it_predicts_more_than_the_steps():
    # 1200 tokens through the queue: the steps say 150 ms; observed, 40 ms + 1200 × 0.1 ms = 160 ms.
    got = predict_ttft(request(prompt=300, cached=100), WorkerLoad("p0", 3, 1000), view(observed=OBSERVED))
    assert got.ttft_s == pytest.approx(0.16, abs=1e-12)
    assert got.prefill_s == pytest.approx(0.03, abs=1e-12)  # its own share of the steps, as before
    assert got.queue_s == pytest.approx(0.13, abs=1e-12)  # the rest is waiting
    # Idle: the steps alone, 30 ms for its 200 tokens (observed would say 60). Behind 100 tokens: steps
    # 40 ms, observed 70 ms. Behind 4800: 5000 tokens are 10 steps, 600 ms, over the observed 540 ms.
    assert ttft_alone_s(request(prompt=300, cached=100), view(observed=OBSERVED)) == pytest.approx(0.03, abs=1e-12)
    assert predict_ttft(request(prompt=300, cached=100), WorkerLoad("p0", 0, 0),
                        view(observed=OBSERVED)).ttft_s == pytest.approx(0.03, abs=1e-12)
    assert predict_ttft(request(prompt=300, cached=100), WorkerLoad("p0", 1, 100),
                        view(observed=OBSERVED)).ttft_s == pytest.approx(0.07, abs=1e-12)
    assert predict_ttft(request(prompt=300, cached=100), WorkerLoad("p0", 9, 4800),
                        view(observed=OBSERVED)).ttft_s == pytest.approx(0.60, abs=1e-12)


def test_a_fully_cached_prompt_still_computes_one_token():
    got = predict_ttft(request(prompt=64, cached=64), WorkerLoad("p0", 0, 0), view())
    assert got.prefill_s == pytest.approx(0.01 + 1e-4, abs=1e-12)


def test_best_prefill_is_the_fastest_then_the_smallest_id():
    workers = (WorkerLoad("p2", 0, 50), WorkerLoad("p1", 0, 50), WorkerLoad("p0", 0, 4000))
    assert best_prefill(request(), view(workers=workers)).worker_id == "p1"
    assert best_prefill(request(), view(workers=())) is None


def test_segments_walk_finishes_and_end_idle():
    got = list(segments(RUNNING, DECODE))
    assert [(s.steps, s.batch_size) for s in got] == [(2, 3), (48, 2), (45, 1), (0, 0)]
    assert got[1].start_s == pytest.approx(A_DONE_S, abs=1e-12)
    assert got[1].step_s == pytest.approx(SECOND_STEP_S, abs=1e-12)
    assert got[1].batch() == ((48, 202), (93, 302)) and got[1].context_tokens == 504
    assert got[1].batch(5) == ((43, 207), (88, 307))


def test_one_of_three_finishes_before_the_join_so_the_batch_at_join_is_three():
    join_s = A_DONE_S + 3 * SECOND_STEP_S + 0.005  # three whole steps into the second segment
    got = predict_tpot(request(prompt=400), instance(), view(), join_s)
    # Survivors B (context 205) and C (305) plus the newcomer (400 prompt + its first token).
    assert (got.batch_size, got.context_tokens) == (3, 205 + 305 + 401)
    assert got.tpot_s == pytest.approx(0.01 + 3 * 0.001 + 911e-6, abs=1e-12)


def test_a_sequence_finishing_exactly_at_the_join_has_left():
    assert project(RUNNING, DECODE, A_DONE_S) == ((48, 202), (93, 302))
    assert project(RUNNING, DECODE, A_DONE_S - 1e-6) == ((1, 101), (49, 201), (94, 301))


def test_projection_does_not_depend_on_the_order_sequences_are_listed_in():
    shuffled = (RUNNING[2], RUNNING[0], RUNNING[1])
    assert project(shuffled, DECODE, 0.1) == project(RUNNING, DECODE, 0.1)
    assert list(segments(shuffled, DECODE)) == list(segments(RUNNING, DECODE))


def test_sequences_finishing_together_end_one_segment():
    running = (RunningRequest(0, 5, 10), RunningRequest(0, 9, 10), RunningRequest(0, 5, 10))
    assert [(s.steps, s.batch_size, s.context_tokens) for s in segments(running, DECODE)] == [
        (5, 3, 30), (4, 1, 15), (0, 0, 0)]


def test_projection_now_and_long_after():
    assert project(RUNNING, DECODE, 0.0) == ((2, 100), (50, 200), (95, 300))
    assert project(RUNNING, DECODE, 100.0) == ()
    assert project((RunningRequest(10, 10, 50),), DECODE, 0.0) == ()  # already at its limit


def test_full_prediction_joins_at_ttft_plus_transfer():
    got = predict(request(prompt=400), view())
    ttft_s = drain_time_s(400, PREFILL, 512)  # 50 ms, one step
    join_s = ttft_s + 0.002 + 400 * 1000 * 1e-9
    tpot = predict_tpot(request(prompt=400), instance(), view(), join_s)
    want = Prediction(ttft_s, tpot.tpot_s, 0.0, ttft_s, join_s - ttft_s, "p0", "d0", tpot.batch_size,
                      tpot.context_tokens)
    assert got == pytest.approx(want, abs=1e-12)
    # 52.4 ms is past A's end (27.2 ms) and two 12.504 ms steps into the second segment.
    assert (got.decode_batch_size, got.decode_context_tokens) == (3, 204 + 304 + 401)


def test_decode_candidates_need_room_for_the_prompt_and_first_token():
    full = instance("d0", running=(), free=25, total=200)  # 400 + 1 tokens need 26 blocks of 16
    busy = instance("d1")
    idle = instance("d2", running=(), free=26, total=200)
    assert best_decode(request(prompt=400), view(instances=(full, busy, idle)), 0.0).instance_id == "d2"
    assert best_decode(request(prompt=400), view(instances=(full,)), 0.0) is None
    assert predict(request(prompt=400), view(instances=(full,))) is None


def test_time_until_the_step_fits_a_budget():
    newcomer = 401
    # With the newcomer: batch 4 now, 15.001 ms; batch 3 after A, 13.905 ms; batch 2 after B, 12.704 ms.
    assert time_until_step_within_s(RUNNING, DECODE, newcomer, 0.0151) == 0.0
    assert time_until_step_within_s(RUNNING, DECODE, newcomer, 0.0141) == pytest.approx(A_DONE_S, abs=1e-12)
    after_b = A_DONE_S + 48 * SECOND_STEP_S
    assert time_until_step_within_s(RUNNING, DECODE, newcomer, 0.0128) == pytest.approx(after_b, abs=1e-12)
    assert time_until_step_within_s(RUNNING, DECODE, newcomer, 0.0110) is None  # 11.401 ms even alone


def test_time_until_blocks_free_counts_finishes_and_growth():
    # Held by the sequences: A 7 blocks, B 13, C 19 = 39 of 50; 1 held by something else; 10 free.
    at = dict(running=RUNNING, fit=DECODE, blocks_free=10, blocks_total=50, block_size_tokens=16)
    assert time_until_blocks_free_s(**at, blocks_needed=10) == 0.0
    # After A: B at 202 (13 blocks), C at 302 (19 blocks): 50 − 1 − 32 = 17 free.
    assert time_until_blocks_free_s(**at, blocks_needed=17) == pytest.approx(A_DONE_S, abs=1e-12)
    assert time_until_blocks_free_s(**at, blocks_needed=49) is not None
    assert time_until_blocks_free_s(**at, blocks_needed=50) is None


def test_first_finish():
    assert first_finish_s(RUNNING, DECODE) == pytest.approx(A_DONE_S, abs=1e-12)
    assert first_finish_s((), DECODE) is None


def test_admission_request_from_a_router_request():
    from engine.sampling_params import SamplingParams
    from router.validation import RouterRequest
    routed = RouterRequest("r1", (5, 6, 7, 8), SamplingParams(max_tokens=9), 3, "t", 250.0, None, False, None)
    assert AdmissionRequest.from_router_request(routed, 2) == AdmissionRequest(4, 2, 9, 250.0, None, 3)


def test_views_validate_their_fields():
    with pytest.raises(ValueError, match="kv_blocks_free"):
        instance(free=300, total=200)
    with pytest.raises(ValueError, match="block_size_tokens"):
        view(block_size=0)
    with pytest.raises(ValueError, match="num_cached_tokens_expected"):
        request(prompt=10, cached=11)
    with pytest.raises(ValueError, match="ttft_ms"):
        AdmissionRequest(10, 0, 1, 0.0, None, 0)
    with pytest.raises(ValueError, match="prefill_fit"):
        ClusterView((), (), PrefillTimeFit(-1.0, 0.0, 0.0), DECODE, TRANSFER, 0, 16, 512)


def test_time_waited_before_the_router_counts_toward_ttft_but_not_toward_the_join():
    waited = dataclasses.replace(request(prompt=300, cached=100), waited_s=0.05)
    got = predict_ttft(waited, WorkerLoad("p0", 3, 1000), view())
    # As in the first TTFT test (queue 120 ms, own prefill 30 ms), plus the 50 ms already spent: the
    # client sees 200 ms; the sequence still joins its decode instance 152.3 ms from now.
    assert got.ttft_s == pytest.approx(0.20, abs=1e-12)
    assert got.queue_s == pytest.approx(0.17, abs=1e-12)
    assert got.prefill_s == pytest.approx(0.03, abs=1e-12)
    assert got.waited_s == 0.05
    assert got.join_s == pytest.approx(0.1523, abs=1e-12)
