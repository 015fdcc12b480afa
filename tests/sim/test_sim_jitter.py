"""The host's jitter around route and adopt (Overheads.route_jitter_s / adopt_jitter_s): each request
draws one sample of each, by a hash of its index, on top of the fixed parts, floored at 0."""
from __future__ import annotations

from collections import Counter

import pytest

from sim import SimConfig, SimRequest, simulate
from sim.profile import Overheads, Profile
from tests.sim.sim_factories import linear_profile

approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731


def test_a_request_pays_its_route_and_adopt_draws_on_top_of_the_fixed_parts():
    # route 1 + 4 ms, prefill 2 ms -> first token at 7 ms; hand-off 6 ms, adopt 2 + 3 ms, then two
    # decode steps of 1.01 ms: last token at 7 + 6 + 5 + 2.02 ms.
    over = Overheads(route_s=0.001, adopt_s=0.002, route_jitter_s=(0.004,), adopt_jitter_s=(0.003,))
    (record,) = simulate(SimConfig(), linear_profile(overheads=over), [SimRequest(0.0, 100, 3)]).records
    assert (record.first_token_s, record.last_token_s) == (approx(0.007), approx(0.02002))


def test_a_draw_below_the_fixed_part_floors_it_at_zero():
    over = Overheads(route_s=0.001, adopt_s=0.002, route_jitter_s=(-0.005,), adopt_jitter_s=(-0.001,))
    (record,) = simulate(SimConfig(), linear_profile(overheads=over), [SimRequest(0.0, 100, 3)]).records
    assert (record.first_token_s, record.last_token_s) == (approx(0.002), approx(0.002 + 0.006 + 0.001 + 0.00202))


def test_draws_are_fixed_by_the_key_and_spread_over_every_sample():
    over = Overheads()
    samples = (0.001, 0.002, 0.003, 0.004)
    draws = [over.jitter_s(samples, key) for key in range(4000)]
    assert draws == [over.jitter_s(samples, key) for key in range(4000)]
    assert all(900 <= count <= 1100 for count in Counter(draws).values()) and len(set(draws)) == 4
    assert over.jitter_s((), 7) == 0.0


def test_runs_with_jitter_are_deterministic_and_slower_in_the_tail_only_where_samples_say():
    requests = [SimRequest(i * 0.05, 64 + 7 * i, 4) for i in range(40)]
    stalls = (0.0,) * 9 + (0.08,)  # one probe in ten met an 80 ms stall
    plain = simulate(SimConfig(), linear_profile(), requests).records
    jittered = linear_profile(overheads=Overheads(route_jitter_s=stalls))
    once, again = (simulate(SimConfig(), jittered, requests).records for _ in range(2))
    assert [r.first_token_s for r in once] == [r.first_token_s for r in again]
    delays = sorted(round(j.ttft_s - p.ttft_s, 9) for j, p in zip(once, plain, strict=True))
    assert delays[0] == 0.0 and delays[-1] >= 0.08 and 0 < sum(d >= 0.08 for d in delays) < 12


def test_jitter_round_trips_through_a_profile_and_must_be_finite(tmp_path):
    over = Overheads(route_s=0.003, route_jitter_s=(-0.001, 0.0425), adopt_jitter_s=(0.002,))
    loaded = Profile.load(linear_profile(overheads=over).save(tmp_path / "p.json")).overheads
    assert loaded.route_jitter_s == pytest.approx(over.route_jitter_s)
    assert loaded.adopt_jitter_s == pytest.approx(over.adopt_jitter_s)
    assert over.fixed() == Overheads(route_s=0.003)
    with pytest.raises(ValueError, match="route_jitter_s"):
        Overheads(route_jitter_s=(float("nan"),))
