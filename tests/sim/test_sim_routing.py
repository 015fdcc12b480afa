"""The simulator routes with the router's own policy objects and prefix index (sim/router.py)."""

from __future__ import annotations

import asyncio

import pytest

from policies.routing import POLICIES as REGISTRY
from policies.routing import CacheAwarePolicy, RouteQuery
from prefix_index.memory import InProcessPrefixIndex
from sim import Fault, SimConfig, SimRequest
from sim.config import POLICIES
from sim.drive import run_now
from sim.simulator import Simulation
from tests.sim.sim_factories import linear_profile


def test_run_now_returns_what_a_coroutine_that_never_waits_returns_and_refuses_one_that_waits():
    async def answer():
        return 42

    assert run_now(answer()) == 42
    with pytest.raises(RuntimeError, match="suspended"):
        run_now(asyncio.sleep(0))


def test_every_simulator_policy_is_the_routers_own():
    assert set(POLICIES) <= set(REGISTRY)
    for name in POLICIES:
        sim = Simulation(SimConfig(prefill=2, policy=name), linear_profile())
        assert sim.router.policy.name == name
    assert isinstance(Simulation(SimConfig(), linear_profile()).router.policy, CacheAwarePolicy)
    assert isinstance(Simulation(SimConfig(), linear_profile()).router.index, InProcessPrefixIndex)


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_serves_a_shared_prefix_workload_and_leaks_nothing(policy):
    requests = [SimRequest(i * 0.004, 200, 4, tuple((i % 5, j) for j in range(8 + i % 4))) for i in range(120)]
    config = SimConfig(
        prefill=3, decode=2, policy=policy, prefill_kv_tokens=4096, faults=(Fault(0.2, "prefill", 1),), restart_s=0.05
    )
    sim = Simulation(config, linear_profile())
    result = sim.run(requests)
    assert all(r.status == "ok" for r in result.records)
    assert sim.router.queued == [0, 0, 0] and sim.router.inflight == [0, 0, 0]
    sim.router.pull()
    run_now(sim.router.index.check_integrity())
    if policy in ("cache_aware", "prefix_hash"):
        assert result.summary().prefix_hit_rate > 0.5  # five conversations, sticky


def test_the_simulated_choice_is_the_policys_on_the_same_index_and_loads():
    requests = [SimRequest(i * 0.01, 300, 2, tuple((i % 3, j) for j in range(18))) for i in range(30)]
    sim = Simulation(SimConfig(prefill=4, decode=1), linear_profile())
    seen = []
    choose = sim.router.choose_prefill

    def spy(keys, prompt_tokens, prompt_key):
        sim.router.pull()
        loads = list(sim.router._loads)
        query = RouteQuery(tuple(keys), prompt_tokens, sim.router.block_tokens, prompt_key)
        expected = asyncio.run(CacheAwarePolicy(sim.router.index).choose(query, loads))
        got = choose(keys, prompt_tokens, prompt_key)
        seen.append(got)
        assert got == (
            int(expected.worker_id.split("-")[1]),
            max(prompt_tokens - expected.expected_cached_blocks * sim.router.block_tokens, 1),
            None,  # prefix pulls are off by default
        )
        return got

    sim.router.choose_prefill = spy  # type: ignore[method-assign]
    sim.run(requests)
    assert len(seen) == 30 and any(uncached < 300 for _, uncached, _ in seen)
