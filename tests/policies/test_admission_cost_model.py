"""The online cost models, fitted from synthetic step statistics with exactly known coefficients."""
from __future__ import annotations

import math

import numpy as np
import pytest

from policies.admission.cost_model import (DECODE_PRIOR, OBSERVED_TTFT_PRIOR, PREFILL_PRIOR, DecodeCostModel,
                                         DecodeStepFit, ObservedTtftFit, ObservedTtftModel, PrefillCostModel,
                                         PrefillTimeFit, TransferCostModel, TransferTimeFit)
from policies.admission.linear_fit import WindowedLinearFit
from policies.admission.step_stats import DecodeStep, PrefillStep, TransferStep, TtftSample, step_problem

TOKENS = (16, 64, 128, 300, 512, 1024, 2048, 4096)


def assert_fit(actual, expected) -> None:
    assert type(actual) is type(expected)
    for name, got, want in zip(expected._fields, actual, expected):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), name


def test_prefill_fit_recovers_a_quadratic_exactly():
    truth = PrefillTimeFit(0.004, 2e-5, 3e-9)
    model = PrefillCostModel(min_samples=3)
    for tokens in TOKENS:
        assert model.observe(PrefillStep(tokens, truth.time_s(tokens)))
    assert_fit(model.fit(), truth)
    assert model.prefill_time_s(1000) == pytest.approx(0.004 + 0.02 + 0.003, rel=1e-12)
    model.check_integrity()


def test_prefill_fit_on_a_line_gives_no_square_term():
    truth = PrefillTimeFit(0.01, 1e-4, 0.0)
    model = PrefillCostModel()
    for tokens in TOKENS:
        model.observe(PrefillStep(tokens, truth.time_s(tokens)))
    assert_fit(model.fit(), truth)


def test_prior_until_min_samples():
    model = PrefillCostModel(min_samples=8)
    for tokens in TOKENS[:7]:
        model.observe(PrefillStep(tokens, 1.0))
    assert model.fit() == PREFILL_PRIOR and model.num_samples == 7
    assert DecodeCostModel().fit() == DECODE_PRIOR


def test_square_term_needs_three_distinct_sizes_and_keeps_its_prior_until_then():
    prior = PrefillTimeFit(0.5, 0.5, 1e-9)  # far-off fixed and per-token priors, the true square term
    truth = PrefillTimeFit(0.003, 4e-5, 1e-9)
    model = PrefillCostModel(prior=prior, min_samples=2)
    for tokens in (100, 900, 100, 900):
        model.observe(PrefillStep(tokens, truth.time_s(tokens)))
    assert_fit(model.fit(), truth)  # the line through what the prior square term leaves over


def test_a_single_step_size_fits_only_the_fixed_cost():
    prior = PrefillTimeFit(0.010, 1e-4, 0.0)
    model = PrefillCostModel(prior=prior, min_samples=2)
    model.observe(PrefillStep(200, 0.05))
    model.observe(PrefillStep(200, 0.07))
    assert_fit(model.fit(), PrefillTimeFit(0.06 - 200 * 1e-4, 1e-4, 0.0))


def test_window_forgets_the_old_regime_completely():
    old, new = PrefillTimeFit(0.02, 3e-4, 0.0), PrefillTimeFit(0.005, 5e-5, 2e-9)
    model = PrefillCostModel(window_steps=8, min_samples=8)
    for truth in (old, new):
        for tokens in TOKENS:
            model.observe(PrefillStep(tokens, truth.time_s(tokens)))
    assert model.num_samples == 8
    assert_fit(model.fit(), new)


def test_decode_fit_recovers_a_plane_exactly():
    truth = DecodeStepFit(0.012, 3e-4, 2e-7)
    model = DecodeCostModel(min_samples=3)
    for batch, context in ((1, 100), (4, 3000), (8, 2000), (16, 40000), (32, 9000), (64, 120000)):
        assert model.observe(DecodeStep(batch, context, truth.step_time_s(batch, context)))
    assert_fit(model.fit(), truth)
    assert model.decode_step_time_s(10, 5000) == pytest.approx(0.012 + 0.003 + 0.001, rel=1e-12)


def test_decode_at_batch_one_only_folds_the_per_request_cost_into_the_fixed_cost():
    truth = DecodeStepFit(0.012, 3e-4, 2e-7)
    model = DecodeCostModel(min_samples=2)
    for context in (100, 500, 900, 2000):
        model.observe(DecodeStep(1, context, truth.step_time_s(1, context)))
    prior_per_request = DECODE_PRIOR.per_request_s
    assert_fit(model.fit(), DecodeStepFit(0.012 + 3e-4 - prior_per_request, prior_per_request, 2e-7))


def test_negative_coefficient_is_pinned_to_zero_and_the_rest_refitted():
    sizes = np.array([1e6, 4e6, 9e6, 2e7])
    durations = 1e-9 * sizes - 0.0005  # least squares would say latency −0.5 ms
    model = TransferCostModel(min_samples=2)
    for size, duration in zip(sizes, durations):
        model.observe(TransferStep(int(size), float(duration)))
    per_byte = float(np.sum(sizes * durations) / np.sum(sizes**2))  # the line through the origin
    assert_fit(model.fit(), TransferTimeFit(0.0, per_byte))
    model.check_integrity()


def test_a_constant_step_time_fits_as_a_fixed_cost_not_the_prior():
    model = DecodeCostModel(min_samples=4)
    rng = np.random.default_rng(0)
    for _ in range(64):
        model.observe(DecodeStep(int(rng.integers(1, 128)), int(rng.integers(100, 100_000)), 0.02))
    fit = model.fit()
    assert fit.intercept_s == pytest.approx(0.02, abs=1e-9)
    assert fit.per_request_s == pytest.approx(0.0, abs=1e-12)
    assert fit.per_context_token_s == pytest.approx(0.0, abs=1e-15)


def test_transfer_fit_gives_latency_and_bandwidth():
    model = TransferCostModel(min_samples=2)
    for size in (1_000_000, 5_000_000, 20_000_000):
        model.observe(TransferStep(size, 0.002 + size / 5e9))
    fit = model.fit()
    assert fit.latency_s == pytest.approx(0.002, rel=1e-9)
    assert fit.bandwidth_bytes_per_s == pytest.approx(5e9, rel=1e-9)
    assert model.transfer_time_s(10_000_000) == pytest.approx(0.004, rel=1e-9)


@pytest.mark.parametrize("step, problem", [
    (PrefillStep(10, 0.0), "duration_s"), (PrefillStep(10, math.nan), "duration_s"),
    (PrefillStep(10, -1.0), "duration_s"), (PrefillStep(0, 0.1), "num_tokens"),
    (PrefillStep(-3, 0.1), "num_tokens"), (PrefillStep(True, 0.1), "num_tokens"),
    (DecodeStep(0, 10, 0.1), "batch_size"), (DecodeStep(2, -1, 0.1), "total_context_tokens"),
    (TransferStep(10, math.inf), "duration_s"), (TransferStep(1.5, 0.1), "num_bytes"),
    (TtftSample(0, 0.1), "tokens_through"), (TtftSample(440, 0.0), "duration_s"),
])
def test_unusable_samples_are_named_dropped_and_counted(step, problem):
    assert problem in step_problem(step)
    model = {PrefillStep: PrefillCostModel, DecodeStep: DecodeCostModel, TransferStep: TransferCostModel,
             TtftSample: ObservedTtftModel}[type(step)]()
    before = model.fit()
    assert model.observe(step) is False
    assert model.rejected_samples == 1 and model.num_samples == 0 and model.fit() == before
    model.check_integrity()


def test_usable_samples_have_no_problem():
    assert step_problem(PrefillStep(np.int64(5), np.float32(0.5))) is None
    assert step_problem(DecodeStep(1, 0, 0.01)) is None
    assert step_problem(TransferStep(0, 0.001)) is None


def test_fitter_rejects_bad_settings():
    with pytest.raises(ValueError, match="min_samples"):
        WindowedLinearFit((1.0,), window=4, min_samples=5)
    with pytest.raises(ValueError, match="prior"):
        WindowedLinearFit((1.0, -1.0), window=4, min_samples=1)
    with pytest.raises(ValueError, match="expected 2 features"):
        WindowedLinearFit((1.0, 1.0), window=4, min_samples=1).add((1.0,), 1.0)


def test_zero_cost_fits_time_nothing():
    assert PrefillTimeFit(0.01, 1e-4, 0.0).time_s(0) == 0.0
    assert DecodeStepFit(0.01, 1e-4, 1e-7).step_time_s(0, 0) == 0.0
    assert TransferTimeFit(0.001, 0.0).bandwidth_bytes_per_s == math.inf


def test_observed_ttft_fit_recovers_overhead_and_queue_rate():
    # 40 ms around every request, 50 µs per uncached token through the queue: a burst's first tokens.
    model = ObservedTtftModel(min_samples=3)
    for tokens_through in (440, 880, 1320, 4400, 8800):
        assert model.observe(TtftSample(tokens_through, 0.040 + 5e-5 * tokens_through))
    assert_fit(model.fit(), ObservedTtftFit(0.040, 5e-5))
    assert model.fit().time_s(2000) == pytest.approx(0.140, rel=1e-12)
    model.check_integrity()


def test_observed_ttft_is_zero_until_min_samples_then_one_queue_length_fits_the_overhead_only():
    model = ObservedTtftModel(min_samples=2)
    model.observe(TtftSample(440, 0.060))
    assert model.fit() == OBSERVED_TTFT_PRIOR and model.fit().time_s(10_000) == 0.0  # the step models decide
    model.observe(TtftSample(440, 0.080))
    # Idle-cluster requests of one size cannot tell overhead from rate: the mean TTFT, no queue slope.
    assert_fit(model.fit(), ObservedTtftFit(0.070, 0.0))
