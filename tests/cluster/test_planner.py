"""The online planner's decision (cluster/planner.py) on the linear test profile: direction, floor,
hysteresis, cooldown and the routers' attainment veto, with exact pool sizes; its config errors; the
controller's sum of router traffic reports (common/traffic.py), exactly."""
from __future__ import annotations

import pytest

from common.config import ClusterConfig, ConfigError
from cluster.planner import Observation, Planner, PlannerConfig, Pools
from common.traffic import TrafficCounts, TrafficWindow
from tests.sim.sim_factories import linear_profile

CONFIG = PlannerConfig(ttft_ms=100.0, tpot_ms=100.0, cooldown_s=60.0, scale_down_intervals=2, max_workers=6,
                       window_requests=200)
LOW = Observation(10.0, 1000.0, 2.0)  # ~10k prompt tokens/s: one prefill worker is plenty
HIGH = Observation(130.0, 1000.0, 2.0)  # ~130k tokens/s: beyond one worker's ~95k


def test_desired_follows_the_load_and_never_goes_below_one():
    planner = Planner(CONFIG, linear_profile())
    assert planner.desired(LOW) == Pools(1, 1)
    assert planner.desired(HIGH).prefill >= 2
    assert planner.desired(Observation(0.0, 0.0, 0.0)) == Pools(1, 1)
    assert planner.step(Observation(0.0, 0.0, 0.0), Pools(1, 1), now_s=0.0) is None


def test_growth_is_immediate_then_cooldown_then_a_shrink_needs_two_votes():
    planner = Planner(CONFIG, linear_profile())
    grown = planner.step(HIGH, Pools(1, 1), now_s=0.0)
    assert grown is not None and grown.prefill >= 2 and grown.decode >= 1
    assert planner.step(LOW, grown, now_s=30.0) is None  # cooling down
    assert planner.step(LOW, grown, now_s=61.0) is None  # first vote for a shrink
    assert planner.step(LOW, grown, now_s=91.0) == Pools(1, 1)  # second vote: shrink, never below 1
    assert planner.step(HIGH, Pools(1, 1), now_s=100.0) is None  # cooldown after the shrink too


def test_a_blip_does_not_shrink():
    planner = Planner(CONFIG, linear_profile())
    current = planner.step(HIGH, Pools(1, 1), now_s=0.0)
    assert planner.step(LOW, current, now_s=100.0) is None  # one vote
    assert planner.step(HIGH, current, now_s=130.0) is None  # load is back: the vote resets
    assert planner.step(LOW, current, now_s=160.0) is None  # one vote again, not two


def test_missing_the_slo_observed_vetoes_a_shrink():
    planner = Planner(CONFIG, linear_profile())
    current = planner.step(HIGH, Pools(1, 1), now_s=0.0)
    missing = LOW._replace(attainment=0.5)  # the routers see the SLO missed: the profile is optimistic
    assert [planner.step(missing, current, now_s=t) for t in (100.0, 130.0, 160.0)] == [None] * 3
    assert planner.step(LOW._replace(attainment=1.0), current, now_s=190.0) is None  # one vote
    assert planner.step(LOW._replace(attainment=1.0), current, now_s=220.0) == Pools(1, 1)


def test_pools_that_meet_the_slo_are_not_reshuffled_toward_another_shape():
    planner = Planner(CONFIG, linear_profile())
    assert planner.desired(LOW) == Pools(1, 1)
    assert planner.meets(LOW, Pools(1, 2))  # more decode than needed: a shrink, never a grow
    assert planner.step(LOW, Pools(1, 2), now_s=0.0) is None
    assert planner.step(LOW, Pools(1, 2), now_s=1.0) == Pools(1, 1)
    assert planner.desired(HIGH, ceiling=Pools(1, 3)) is None  # one prefill worker cannot do HIGH


@pytest.mark.parametrize("raw, key", [({"cooldown_s": 0}, "planner.cooldown_s"),
                                      ({"max_workers": 1}, "planner.max_workers"),
                                      ({"enabled": True}, "planner.profile_path"),
                                      ({"attainment": 1.5}, "planner.attainment"),
                                      ({"interval_s": 1.0, "report_interval_s": 2.0}, "planner.report_interval_s"),
                                      ({"interval_s": "fast"}, "planner.interval_s"),
                                      ({"every_s": 1}, "planner.every_s")])
def test_config_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=key):
        ClusterConfig.from_dict({"planner": raw})


def test_traffic_window_sums_router_deltas_over_the_interval():
    window = TrafficWindow(keep_s=10.0)
    window.add("a", TrafficCounts(4, 400, 2, 20, 1), now_s=1.0)
    window.add("b", TrafficCounts(2, 100, 2, 4, 2), now_s=1.5)
    window.add("a", TrafficCounts(10, 1000, 8, 80, 7), now_s=3.0)  # cumulative: the delta is (6, 600, 6, 60, 6)
    assert window.observe(now_s=3.0, window_s=2.0) == Observation(8 / 2.0, 700 / 8, 64 / 8, 8 / 8, routers=2)
    window.add("b", TrafficCounts(1, 10, 0, 0, 0), now_s=4.0)  # a restarted router counts from zero again
    assert window.observe(now_s=4.5, window_s=1.0) == Observation(1.0, 10.0, 8.0, None, routers=1)  # lengths: last known
    assert window.observe(now_s=30.0, window_s=2.0).arrival_rate_per_s == 0.0
