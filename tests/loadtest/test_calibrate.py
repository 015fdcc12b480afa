"""`fit_overheads` recovers the cluster overheads and the prefill scale that produced the probes:
probes here are the simulator's own figures for a profile with known overheads (the linear test
profile), so every fitted value is exact."""

from __future__ import annotations

import dataclasses

import pytest

from sim.config import SimConfig
from sim.profile import Overheads, Profile
from sim.seq import SimRequest
from sim.simulator import simulate
from sim.step_cost import prefill_pairs
from loadtest.calibrate import _alone, fit_overheads
from loadtest.probes import Probe
from tests.sim.sim_factories import linear_profile

TRUTH = Overheads(route_s=0.005, adopt_s=0.007, step_s=0.0005, prefill_step_scale=1.5)


def _probes(overheads: Overheads, lengths: list[int], host: SimConfig | None = None) -> list[Probe]:
    truth = linear_profile().with_overheads(overheads)
    return [_alone(truth, Probe(n, 0.0, 0.0, 0.0), 16, host or SimConfig()) for n in lengths]


def test_the_fit_recovers_route_adopt_step_and_the_prefill_scale():
    fitted, rows = fit_overheads(linear_profile(), _probes(TRUTH, [64, 256, 64, 256]))
    assert fitted.route_s == pytest.approx(TRUTH.route_s)
    assert fitted.adopt_s == pytest.approx(TRUTH.adopt_s)
    assert fitted.step_s == pytest.approx(TRUTH.step_s)
    assert fitted.prefill_step_scale == pytest.approx(TRUTH.prefill_step_scale)
    # The rows show the simulation before route: what is left over is route alone, at every length.
    assert [r["ttft_ms"] - r["sim_ttft_ms"] for r in rows] == pytest.approx([5.0] * 4)


def test_with_a_host_model_the_fit_leaves_to_the_overheads_only_what_the_host_does_not_explain():
    # Probes timed on a 1-core host whose streaming costs 1 ms per token: a batch-1 decode step of
    # 1.01 ms + 0.5 ms overhead is stretched there (one engine and ~0.7 core of streaming on 1 core).
    # Without the host model the stretch lands in the step overhead; with it the overheads are recovered.
    host = SimConfig(host_cores=1, host_stream_cpu_per_token_s=0.001)
    probes = _probes(TRUTH, [64, 256, 64, 256], host)
    fitted, _ = fit_overheads(linear_profile(), probes, host=host)
    assert fitted.step_s == pytest.approx(TRUTH.step_s, abs=1e-6)
    assert fitted.prefill_step_scale == pytest.approx(TRUTH.prefill_step_scale, rel=1e-3)
    assert (fitted.route_s, fitted.adopt_s) == (
        pytest.approx(TRUTH.route_s, abs=1e-5),
        pytest.approx(TRUTH.adopt_s, abs=1e-5),
    )
    unaware, _ = fit_overheads(linear_profile(), probes)
    assert unaware.step_s > TRUTH.step_s + 0.0005  # the host's stretch counted as overhead


def test_one_prompt_length_cannot_tell_a_scale_from_a_route():
    fitted, _ = fit_overheads(linear_profile(), _probes(TRUTH, [128, 128]))
    assert fitted.prefill_step_scale == 1.0  # the whole difference lands in route
    assert fitted.route_s > TRUTH.route_s


def test_the_scale_stays_within_its_range_and_round_trips_through_a_profile(tmp_path):
    wild = Overheads(route_s=0.005, step_s=0.0005, prefill_step_scale=20.0)
    fitted, _ = fit_overheads(linear_profile(), _probes(wild, [64, 256]))
    assert fitted.prefill_step_scale == 4.0
    saved = linear_profile().with_overheads(fitted).save(tmp_path / "p.json")
    loaded = Profile.load(saved).overheads
    fixed = [f.name for f in dataclasses.fields(Overheads) if not f.name.endswith("_jitter_s")]
    assert [getattr(loaded, f) for f in fixed] == pytest.approx([getattr(fitted, f) for f in fixed])
    assert loaded.route_jitter_s == pytest.approx(fitted.route_jitter_s, abs=1e-12)
    with pytest.raises(ValueError, match="prefill_step_scale"):
        Overheads(prefill_step_scale=0.0)


def _mean_decode_step_s(overheads: Overheads, lengths: list[int], host: SimConfig | None = None) -> float:
    """What the decode workers' step timings read over the probes: their engine steps, without the
    loop's step overhead around them."""
    engine_only = linear_profile().with_overheads(dataclasses.replace(overheads, step_s=0.0))
    results = [simulate(host or SimConfig(), engine_only, [SimRequest(0.0, n, 16)]) for n in lengths]
    return sum(r.busy_s["decode"] for r in results) / sum(r.steps["decode"] for r in results)


def test_a_measured_decode_step_gives_the_decode_scale_and_the_step_overhead_directly():
    truth = dataclasses.replace(TRUTH, decode_step_scale=1.3)
    lengths = [64, 256, 64, 256]
    fitted, rows = fit_overheads(
        linear_profile(), _probes(truth, lengths), 16, None, _mean_decode_step_s(truth, lengths)
    )
    assert fitted.decode_step_scale == pytest.approx(1.3)
    assert fitted.step_s == pytest.approx(TRUTH.step_s)
    assert (fitted.route_s, fitted.adopt_s) == pytest.approx((TRUTH.route_s, TRUTH.adopt_s))
    assert fitted.prefill_step_scale == pytest.approx(TRUTH.prefill_step_scale)
    assert [r["per_token_ms"] for r in rows] == pytest.approx([r["sim_per_token_ms"] for r in rows])
    # Fitted without the measurement, the decode engine's 30% in-process slowdown lands in the overhead.
    unmeasured, _ = fit_overheads(linear_profile(), _probes(truth, lengths))
    assert unmeasured.decode_step_scale == 1.0 and unmeasured.step_s > TRUTH.step_s + 0.0002


def test_with_a_host_model_the_decode_scale_is_what_the_host_stretch_leaves():
    # On the 1-core host of the test above the batch-1 decode steps are stretched; the workers' timings
    # include that stretch, so the scale that reproduces them is the in-process part alone (1.3).
    host = SimConfig(host_cores=1, host_stream_cpu_per_token_s=0.001)
    truth = Overheads(decode_step_scale=1.3)
    lengths = [64, 256, 64, 256]
    measured_step_s = _mean_decode_step_s(truth, lengths, host)
    fitted, rows = fit_overheads(linear_profile(), _probes(truth, lengths, host), 16, host, measured_step_s)
    assert fitted.decode_step_scale == pytest.approx(1.3, rel=0.01)
    assert [r["per_token_ms"] for r in rows] == pytest.approx([r["sim_per_token_ms"] for r in rows], rel=0.01)
    with pytest.raises(ValueError, match="decode step"):
        fit_overheads(linear_profile(), _probes(truth, lengths), 16, None, 0.0)


def test_probes_after_several_idle_times_separate_route_from_the_idle_wake_up():
    # The probes of the first test, each sent after 0.1, 0.5 or 2 s idle in turn and waiting the truth's
    # wake-up of 3 ms x ln(1 + idle / 0.1 s) on top: the fit gives route (no idle) and the wake-up apart.
    truth = dataclasses.replace(TRUTH, idle_wake_s=0.003)
    lengths = [64, 256, 128, 512] * 3  # every length after every idle time (as the calibration's cycles)
    idles = [(0.1, 0.5, 2.0)[i % 3] for i in range(len(lengths))]
    probes = [
        p._replace(ttft_s=p.ttft_s + truth.wake_s(idle), idle_s=idle)
        for p, idle in zip(_probes(TRUTH, lengths), idles, strict=True)
    ]
    fitted, _ = fit_overheads(linear_profile(), probes)
    assert (fitted.route_s, fitted.idle_wake_s) == (pytest.approx(TRUTH.route_s), pytest.approx(0.003))
    assert fitted.prefill_step_scale == pytest.approx(TRUTH.prefill_step_scale, rel=0.05)
    # Every probe after the same idle time: no wake-up to tell apart, route takes it all.
    same = [p._replace(ttft_s=p.ttft_s + truth.wake_s(0.5), idle_s=0.5) for p in _probes(TRUTH, lengths)]
    fitted, _ = fit_overheads(linear_profile(), same)
    assert fitted.idle_wake_s == 0.0 and fitted.route_s == pytest.approx(TRUTH.route_s + truth.wake_s(0.5))


def test_a_measured_decode_step_above_the_time_per_token_is_capped_at_it():
    # Step records reading 20% above the probes' time per token (their noise): the scale reproduces the
    # probes' time per token, with no overhead, instead of a step the probes never saw.
    lengths = [64, 256, 64, 256]
    probes = _probes(TRUTH, lengths)
    per_token_s = sorted(p.per_token_s for p in probes)
    median_s = (per_token_s[1] + per_token_s[2]) / 2
    fitted, rows = fit_overheads(linear_profile(), probes, 16, None, 1.2 * median_s)
    assert fitted.step_s == 0.0
    simulated = sorted(r["sim_per_token_ms"] for r in rows)
    assert (simulated[1] + simulated[2]) / 2 == pytest.approx(median_s * 1e3)


def test_measured_prefill_steps_give_the_prefill_scale_directly():
    # The prefill engines timed each probe's prompt at 1.3x the profile's step (plus the step
    # overhead): the scale is 1.3 whatever the TTFTs say (here probes of a 1.5x truth); without the
    # timings the TTFTs' slope gives 1.5.
    profile = linear_profile()
    cost = profile.step_cost(1)
    steps = [(n, 1.3 * cost.seconds(n, 1, prefill_pairs(0, n)) + TRUTH.step_s) for n in (64, 256, 512)]
    probes = _probes(TRUTH, [64, 256, 64, 256])
    measured, _ = fit_overheads(profile, probes, 16, None, None, steps)
    assert (measured.prefill_step_scale, measured.prefill_step_s) == (pytest.approx(1.3), pytest.approx(0.0))
    assert fit_overheads(profile, probes)[0].prefill_step_scale == pytest.approx(1.5)
    # An outlier step (a collection pause) moves neither the slope nor the fixed part.
    noisy = [*steps, (128, 1.0), (128, 1.3 * cost.seconds(128, 1, prefill_pairs(0, 128)) + TRUTH.step_s)]
    assert fit_overheads(profile, probes, 16, None, None, noisy)[0].prefill_step_scale == pytest.approx(1.3)


def test_measured_prefill_steps_separate_a_fixed_cost_per_step_from_the_scale():
    # Steps at 2 ms + 1.2x the profile's: the fit gives both, and the simulated prefill of every
    # length is then the measured one (a ratio alone is right at one length only).
    profile = linear_profile()
    cost = profile.step_cost(1)
    lengths = [32, 64, 128, 256, 384, 512] * 3
    steps = [(n, 0.002 + 1.2 * cost.seconds(n, 1, prefill_pairs(0, n)) + TRUTH.step_s) for n in lengths]
    fitted, _ = fit_overheads(profile, _probes(TRUTH, [64, 256, 64, 256]), 16, None, None, steps)
    assert (fitted.prefill_step_s, fitted.prefill_step_scale) == (pytest.approx(0.002), pytest.approx(1.2))
    worker = profile.with_overheads(fitted)
    for n in (32, 512):
        alone = simulate(SimConfig(), worker, [SimRequest(0.0, n, 1)])
        assert alone.busy_s["prefill"] == pytest.approx(
            0.002 + 1.2 * cost.seconds(n, 1, prefill_pairs(0, n)) + TRUTH.step_s
        )
    # Steps that grow faster than the profile from below its origin would need a negative fixed cost:
    # the median ratio instead, nothing fixed.
    steep = [(n, 1.6 * cost.seconds(n, 1, prefill_pairs(0, n)) - 0.001) for n in lengths]  # 1.1-8.8 ms
    fitted, _ = fit_overheads(profile, _probes(TRUTH, [64, 256]), 16, None, None, steep)
    ratios = sorted((s - fitted.step_s) / cost.seconds(n, 1, prefill_pairs(0, n)) for n, s in steep)
    assert fitted.prefill_step_s == 0.0
    assert fitted.prefill_step_scale == pytest.approx((ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2)


def test_the_fixed_prefill_cost_round_trips_through_a_profile_and_must_not_be_negative():
    profile = linear_profile().with_overheads(Overheads(prefill_step_s=0.0015, prefill_step_scale=1.2))
    assert Profile.from_dict(profile.to_dict()).overheads.prefill_step_s == pytest.approx(0.0015)
    with pytest.raises(ValueError, match="prefill_step_s"):
        Overheads(prefill_step_s=-0.001)


def test_what_each_probe_leaves_beyond_route_and_adopt_becomes_their_jitter():
    # Three probes per length: one stalled probe moves no per-length median, so route, adopt and the
    # scale are recovered and the stall shows as that probe's jitter alone.
    probes = _probes(TRUTH, [64, 256] * 3)
    probes[2] = probes[2]._replace(ttft_s=probes[2].ttft_s + 0.020)
    probes[5] = probes[5]._replace(gap_s=probes[5].gap_s + 0.009)
    fitted, _ = fit_overheads(linear_profile(), probes)
    assert (fitted.route_s, fitted.adopt_s) == (pytest.approx(TRUTH.route_s), pytest.approx(TRUTH.adopt_s))
    assert fitted.route_jitter_s == pytest.approx([0, 0, 0.020, 0, 0, 0], abs=1e-9)
    assert fitted.adopt_jitter_s == pytest.approx([0, 0, 0, 0, 0, 0.009], abs=1e-9)
