"""The online planner's decision (cluster/planner.py) on the linear test profile: direction, floor,
hysteresis and cooldown, with exact pool sizes."""
from __future__ import annotations

import pytest

from cluster.planner import Observation, Planner, PlannerConfig, Pools
from tests.cluster.sim_factories import linear_profile

CONFIG = PlannerConfig(ttft_ms=100.0, tpot_ms=100.0, cooldown_s=60.0, scale_down_intervals=2, max_workers=6,
                       window_requests=200)
LOW = Observation(10.0, 1000.0, 2.0)  # ~10k prompt tokens/s: one prefill worker is plenty
HIGH = Observation(130.0, 1000.0, 2.0)  # ~130k tokens/s: beyond one worker's ~95k


def test_desired_follows_the_load_and_never_goes_below_one():
    planner = Planner(CONFIG, linear_profile())
    assert planner.desired(LOW) == Pools(1, 1)
    assert planner.desired(HIGH).prefill >= 2
    assert planner.desired(Observation(0.0, 0.0, 0.0)) == Pools(1, 1)


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


@pytest.mark.parametrize("kwargs, key", [({"cooldown_s": 0}, "planner.cooldown_s"),
                                         ({"max_workers": 1}, "planner.max_workers"),
                                         ({"enabled": True}, "planner.profile_path"),
                                         ({"attainment": 1.5}, "planner.attainment")])
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        PlannerConfig(**kwargs)
