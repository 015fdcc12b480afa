"""The routing-decision benchmark on small fleets: every pair of algorithms it times chose the same workers
(the figures it reports compare equal decisions), through the policies and through the router's objects."""

from __future__ import annotations

import pytest

from benchmarks.bench_routing_decision import run_router, run_size


@pytest.mark.parametrize("workers", [3, 40])
def test_each_timed_pair_decides_alike(workers):
    policies = run_size(workers, decisions=40, seed=workers)
    assert policies["cache_aware_same_choice"] and policies["least_loaded_same_choice"]
    router = run_router(workers, decisions=40, seed=workers)
    assert router["router_same_choice"]
    assert router["router_scan"]["decisions"] == router["router_books"]["decisions"] == 40
    assert router["router_masked"]["decisions"] == 40
