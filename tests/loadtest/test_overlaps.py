"""loadtest/overlaps.py's fits on the simulator's own overlaps: they recover the prefill interference
and the hand-off cores that produced them, and a median ignores a few paused overlaps."""

from __future__ import annotations

import dataclasses

import pytest

from sim import SimConfig, SimRequest, simulate
from loadtest.overlaps import (
    OVERLAP_OUTPUT_TOKENS,
    OVERLAP_PLAN,
    OVERLAP_STREAM,
    Overlap,
    fit_handoff_cores,
    fit_overlaps,
    fit_prefill_interference,
)
from tests.sim.sim_factories import linear_profile

PROFILE = linear_profile()
HOST = SimConfig(decode=2, host_cores=1, host_stream_cpu_per_token_s=0.002)


def _at_token(streams: int, token: int, config: SimConfig = HOST, profile=PROFILE) -> float:
    """When every one of `streams` A's sent at once has its `token`-th token, simulated on `config`."""
    a = SimRequest(0.0, OVERLAP_STREAM[0], token)  # its last token is the one B waits for
    return max(r.last_token_s for r in simulate(config, profile, [a] * streams).records)


def _overlaps(config: SimConfig, at_token: int) -> list[Overlap]:
    """B's of 1,024-2,048 tokens (long: the A's decode or hand off meanwhile) after one and two A's,
    their TTFTs as `config` simulates them."""
    plan = [Overlap(n, _at_token(k, at_token), 0.0, k, at_token) for k in (1, 2) for n in (1024, 1536, 2048)]
    return [o._replace(ttft_s=simulate(config, PROFILE, o.requests()).records[o.streams].ttft_s) for o in plan]


def test_the_prefill_interference_is_the_factor_at_which_simulated_overlaps_reach_their_first_tokens():
    # On a 1-core host whose prefill worker feels streaming x2.5 more, the fit finds 2.5 back; on the
    # TTFTs of a host with no extra slowdown, 1.
    truth = dataclasses.replace(HOST, host_prefill_interference=2.5)
    assert fit_prefill_interference(PROFILE, HOST, _overlaps(truth, 2)) == pytest.approx(2.5, abs=0.01)
    assert fit_prefill_interference(PROFILE, HOST, _overlaps(HOST, 2)) == 1.0
    # A median: two of six overlaps caught by a 0.5 s pause move it by less than a mean would.
    paused = [o._replace(ttft_s=o.ttft_s + (0.5 if i < 2 else 0.0)) for i, o in enumerate(_overlaps(truth, 2))]
    assert fit_prefill_interference(PROFILE, HOST, paused) == pytest.approx(2.5, abs=0.6)


def test_the_handoff_cores_are_what_makes_prompts_sent_at_the_first_token_as_late_as_measured():
    # A slow link (a 40 ms hand-off per A) on a 1-core host where each hand-off keeps 0.75 cores busy.
    profile = dataclasses.replace(PROFILE, transfer=dataclasses.replace(PROFILE.transfer, latency_s=0.04))
    truth = dataclasses.replace(HOST, host_handoff_cores=0.75)
    sent = [Overlap(n, _at_token(k, 1, truth, profile), 0.0, k, 1) for k in (1, 2) for n in (512, 1024)]
    overlaps = [o._replace(ttft_s=simulate(truth, profile, o.requests()).records[o.streams].ttft_s) for o in sent]
    assert fit_handoff_cores(profile, HOST, overlaps) == pytest.approx(0.75, abs=0.02)
    assert fit_handoff_cores(profile, HOST, [o._replace(ttft_s=0.0) for o in overlaps]) == 0.0


def test_fit_overlaps_fits_each_figure_on_its_own_overlaps():
    profile = dataclasses.replace(PROFILE, transfer=dataclasses.replace(PROFILE.transfer, latency_s=0.04))
    truth = dataclasses.replace(HOST, host_prefill_interference=2.0, host_handoff_cores=0.5)
    sent = [
        Overlap(n, _at_token(k, t, truth, profile), 0.0, k, t)
        for t in (2, 1)
        for k in (1, 2)
        for n in (512, 1024, 2048)
    ]
    overlaps = [o._replace(ttft_s=simulate(truth, profile, o.requests()).records[o.streams].ttft_s) for o in sent]
    fitted = fit_overlaps(profile, HOST, overlaps)
    assert fitted.host_prefill_interference == pytest.approx(2.0, abs=0.05)
    assert fitted.host_handoff_cores == pytest.approx(0.5, abs=0.05)
    assert fit_overlaps(profile, HOST, []) == HOST  # nothing measured: nothing changes


def test_overlap_requests_are_its_streams_then_b_and_the_plan_covers_both_kinds():
    o = Overlap(300, 0.04, 0.05, streams=3)
    assert o.requests() == [SimRequest(0.0, *OVERLAP_STREAM)] * 3 + [SimRequest(0.04, 300, OVERLAP_OUTPUT_TOKENS)]
    assert {(streams, at) for _, streams, at in OVERLAP_PLAN} == {(1, 1), (1, 2), (2, 1), (2, 2)}
