"""Sizing pools with the simulator (sim/search.py) on the linear test profile."""
from __future__ import annotations

import pytest

from sim import SimConfig, SimRequest
from sim.search import base_rate, least_cost, max_rate, rescaled, search, shapes
from tests.sim.sim_factories import linear_profile


def steady(rate_per_s: float, n: int = 200) -> list[SimRequest]:
    # 1000-token prompts: one prefill worker computes ~95k tokens/s (2048-token steps of 21.5 ms).
    return [SimRequest(i / rate_per_s, 1000, 2) for i in range(n)]


def test_rescaling_keeps_lengths_and_scales_the_rate():
    requests = steady(10.0, 11)
    assert base_rate(requests) == pytest.approx(10.0)
    faster = rescaled(requests, 4.0)
    assert base_rate(faster) == pytest.approx(40.0) and [r.prompt_tokens for r in faster] == [1000] * 11


def test_least_cost_adds_a_prefill_worker_when_prefill_saturates():
    base = SimConfig(ttft_slo_s=0.03)
    assert least_cost(linear_profile(), steady(50.0), base, 6, 0.9).name == "1P1D"
    assert least_cost(linear_profile(), steady(125.0), base, 6, 0.9).name == "2P1D"
    assert least_cost(linear_profile(), steady(125.0), base, 2, 0.9) is None
    assert least_cost(linear_profile(), steady(50.0), base, 6, 0.9, floor=(1, 2)).name == "1P2D"


def test_max_rate_grows_with_the_prefill_pool():
    base = SimConfig(ttft_slo_s=0.03)
    one, _ = max_rate(base, linear_profile(), steady(50.0), 0.9)
    two, _ = max_rate(SimConfig(prefill=2, ttft_slo_s=0.03), linear_profile(), steady(50.0), 0.9)
    assert 50 < one < 125 <= two
    assert max_rate(SimConfig(ttft_slo_s=1e-4), linear_profile(), steady(50.0), 0.9)[0] == 0.0


def test_search_enumerates_shapes_within_the_budget_and_ranks_them():
    names = sorted(c.name for c in shapes(SimConfig(), 4, (1, 2)))
    assert names == sorted(["1P1D", "1P2D", "1P3D", "2P1D", "2P2D", "3P1D", "1P1D tp2", "2P1D tp2",
                            "1C", "2C", "3C", "4C", "1C tp2", "2C tp2"])
    rows = search(linear_profile(), steady(50.0, 60), SimConfig(ttft_slo_s=0.03), 3, 0.9)
    assert [r.per_worker for r in rows] == sorted((r.per_worker for r in rows), reverse=True)
    assert all(r.per_worker == pytest.approx(r.max_rate_per_s / r.config.workers) for r in rows)
