"""`fit_in_turn`: the overheads and the host's streaming figures, fitted in turn from one set of
measurements, recover the figures that produced them. The measurements here are the simulator's own
(linear test profile, known overheads, a 1-core host with known streaming costs and interference)."""

from __future__ import annotations

import dataclasses

import pytest

from sim import SimConfig, SimRequest, simulate
from sim.profile import Overheads, Profile
from loadtest.calibrate import _alone
from loadtest.cluster_calibration import fit_in_turn
from loadtest.host_cpu import BurstSample, CpuSample
from loadtest.overlaps import OVERLAP_STREAM, Overlap
from loadtest.probes import Probe
from tests.sim.sim_factories import linear_profile

TRUTH = Overheads(route_s=0.005, adopt_s=0.007, step_s=0.0005, prefill_step_scale=1.5)
HOST = SimConfig(host_cores=1, host_stream_cpu_per_token_s=0.001, host_stream_interference=1.5)
PER_TOKEN_S = 0.001


def _busy_s(profile: Profile, rounds: list[list[SimRequest]]) -> float:
    """Host CPU of `rounds` one after another: the engines' busy time plus the streaming per token."""
    engines = sum(sum(simulate(SimConfig(), profile, r).busy_s.values()) for r in rounds)
    return engines + PER_TOKEN_S * sum(q.output_tokens for r in rounds for q in r)


def _mean_decode_step_s(results) -> float:
    return sum(r.busy_s["decode"] for r in results) / sum(r.steps["decode"] for r in results)


def test_fitting_in_turn_recovers_the_overheads_the_streaming_cost_and_the_interference():
    truth = linear_profile().with_overheads(TRUTH)
    lengths = [64, 256] * 3
    probes = [_alone(truth, Probe(n, 0.0, 0.0, 0.0), 16, HOST) for n in lengths]
    sequential_rounds = [[SimRequest(0.0, n, 16)] for n in lengths]
    burst = [SimRequest(0.0, n, 32) for n in (64, 128, 64, 128)]
    ends = [r.end_s - r.send_s for _ in range(2) for r in simulate(HOST, truth, burst).records]
    sequential = CpuSample(sequential_rounds, _busy_s(truth, sequential_rounds), 10.0)
    bursts = BurstSample(CpuSample([burst] * 2, _busy_s(truth, [burst] * 2), 10.0), ends)
    overheads, _, host = fit_in_turn(linear_profile(), probes, sequential, bursts, SimConfig(host_cores=1))
    assert host.host_stream_cpu_per_token_s == pytest.approx(PER_TOKEN_S, rel=0.01)
    assert host.host_stream_cpu_per_step_s == pytest.approx(0.0, abs=1e-5)
    assert host.host_stream_interference == pytest.approx(1.5, abs=0.02)
    assert overheads.step_s == pytest.approx(TRUTH.step_s, rel=0.02)
    assert overheads.prefill_step_scale == pytest.approx(TRUTH.prefill_step_scale, rel=0.01)
    assert (overheads.route_s, overheads.adopt_s) == pytest.approx((TRUTH.route_s, TRUTH.adopt_s), rel=0.02)


def test_with_the_engines_timed_the_decode_scale_and_step_are_measured_and_the_streaming_fit_uses_them():
    # The same cluster whose decode engine runs 1.3x its profile in the worker. The workers' step timings
    # over the sequential probes give the engines' CPU (unstretched: what they computed) and the decode
    # engine's mean step as the host stretched it (without the loop's step overhead around it).
    truth_overheads = dataclasses.replace(TRUTH, decode_step_scale=1.3)
    truth = linear_profile().with_overheads(truth_overheads)
    lengths = [64, 256] * 3
    probes = [_alone(truth, Probe(n, 0.0, 0.0, 0.0), 16, HOST) for n in lengths]
    sequential_rounds = [[SimRequest(0.0, n, 16)] for n in lengths]
    engine_part = linear_profile().with_overheads(dataclasses.replace(truth_overheads, step_s=0.0))
    alone = [simulate(SimConfig(), engine_part, r) for r in sequential_rounds]
    engines_s = sum(sum(r.busy_s.values()) for r in alone)
    steps, decode_steps = sum(sum(r.steps.values()) for r in alone), sum(r.steps["decode"] for r in alone)
    stretch = _mean_decode_step_s([simulate(HOST, truth, r) for r in sequential_rounds]) / _mean_decode_step_s(
        [simulate(SimConfig(), truth, r) for r in sequential_rounds]
    )
    assert stretch > 1.5  # one engine and its streaming on one core
    decode_step_s = stretch * _mean_decode_step_s(alone)
    busy_s = engines_s + TRUTH.step_s * steps + PER_TOKEN_S * 16 * len(lengths)
    sequential = CpuSample(sequential_rounds, busy_s, 10.0, engines_s, steps, decode_steps)
    burst = [SimRequest(0.0, n, 32) for n in (64, 128, 64, 128)]
    ends = [r.end_s - r.send_s for _ in range(2) for r in simulate(HOST, truth, burst).records]
    bursts = BurstSample(CpuSample([burst] * 2, _busy_s(truth, [burst] * 2), 10.0), ends)
    # Prompts sent while another request streams, on a host whose prefill worker feels streaming x2
    # more than the decode instance: their TTFTs give that factor back.
    overlap_host = dataclasses.replace(HOST, host_prefill_interference=2.0)
    sent_after_s = simulate(HOST, truth, [SimRequest(0.0, *OVERLAP_STREAM)]).records[0].ttft_s
    overlaps = [Overlap(n, sent_after_s, 0.0) for n in (1024, 1536, 2048)]  # long: A decodes meanwhile
    overlaps = [o._replace(ttft_s=simulate(overlap_host, truth, o.requests()).records[1].ttft_s) for o in overlaps]
    start = SimConfig(host_cores=1)
    overheads, _, host = fit_in_turn(linear_profile(), probes, sequential, bursts, start, decode_step_s, overlaps)
    assert host.host_prefill_interference == pytest.approx(2.0, abs=0.05)
    assert overheads.decode_step_scale == pytest.approx(1.3, rel=0.02)
    assert overheads.step_s == pytest.approx(TRUTH.step_s, rel=0.05)
    assert host.host_stream_cpu_per_token_s == pytest.approx(PER_TOKEN_S, rel=0.02)
    assert host.host_stream_cpu_per_step_s == pytest.approx(0.0, abs=2e-5)
    assert host.host_stream_interference == pytest.approx(1.5, abs=0.05)
