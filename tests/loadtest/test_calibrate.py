"""`fit_overheads` recovers the cluster overheads and the prefill scale that produced the probes:
probes here are the simulator's own figures for a profile with known overheads (the linear test
profile), so every fitted value is exact."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.sim.profile import Overheads, Profile
from loadtest.calibrate import Probe, _alone, fit_overheads
from tests.cluster.sim_factories import linear_profile

TRUTH = Overheads(route_s=0.005, adopt_s=0.007, step_s=0.0005, prefill_step_scale=1.5)


def _probes(overheads: Overheads, lengths: list[int]) -> list[Probe]:
    truth = linear_profile().with_overheads(overheads)
    return [_alone(truth, Probe(n, 0.0, 0.0, 0.0), 16) for n in lengths]


def test_the_fit_recovers_route_adopt_step_and_the_prefill_scale():
    fitted, rows = fit_overheads(linear_profile(), _probes(TRUTH, [64, 256, 64, 256]))
    assert fitted.route_s == pytest.approx(TRUTH.route_s)
    assert fitted.adopt_s == pytest.approx(TRUTH.adopt_s)
    assert fitted.step_s == pytest.approx(TRUTH.step_s)
    assert fitted.prefill_step_scale == pytest.approx(TRUTH.prefill_step_scale)
    # The rows show the simulation before route: what is left over is route alone, at every length.
    assert [r["ttft_ms"] - r["sim_ttft_ms"] for r in rows] == pytest.approx([5.0] * 4)


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
    assert dataclasses.astuple(loaded) == pytest.approx(dataclasses.astuple(fitted))
    with pytest.raises(ValueError, match="prefill_step_scale"):
        Overheads(prefill_step_scale=0.0)
