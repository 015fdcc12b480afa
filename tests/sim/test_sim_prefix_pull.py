"""Prefix pulls in the simulator: the router's own PullPlanner decides, the blocks move between the
workers' real pools, the request waits for the modelled transfer, and no block is left pinned.
Times follow by hand from the linear test profile (tests/sim/sim_factories.py): dense(T) = 1 ms +
0.01 ms * T, a KV transfer 5 ms + 0.01 ms per token, 16-token blocks, no overheads."""

from __future__ import annotations

import pytest

from sim import SimConfig, SimRequest
from sim.drive import run_now
from sim.seq import block_hashes
from sim.simulator import Simulation
from tests.sim.sim_factories import dense_s, linear_profile, transfer_s

approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731

SHARED = tuple(("conversation", j) for j in range(12))  # 12 blocks: 192 tokens


def _requests() -> list[SimRequest]:
    """r0 caches the shared prefix on one worker (the holder); r1, a long prompt extending it, follows
    it there (1808 uncached tokens there against 2000 elsewhere) and keeps the holder busy; r2, the
    shared prefix plus 8 tokens, then costs 1808 + 8 on the holder against 200 on the idle worker."""
    return [
        SimRequest(0.0, 200, 1, SHARED),
        SimRequest(1.0, 2000, 1, SHARED + tuple(("long", j) for j in range(113))),
        SimRequest(1.0001, 200, 1, SHARED),
    ]


def _run(prefix_pull: str) -> tuple[Simulation, list]:
    sim = Simulation(SimConfig(prefill=2, decode=1, prefix_pull=prefix_pull), linear_profile())
    return sim, sim.run(_requests()).records


def test_a_pull_moves_the_prefix_and_delays_the_start_by_the_transfer():
    sim, records = _run("always")
    holder = records[0]
    assert [r.status for r in records] == ["ok"] * 3
    # r2 went to the idle worker, which pulled the holder's 12 blocks (all it may: the last token is
    # computed): cached and pulled 192 tokens, 8 computed. It is admitted once the 192 tokens' KV has
    # arrived, 5 + 1.92 ms after it reached the worker, then computes 8 tokens: 1.08 ms.
    r2 = records[2]
    assert (r2.cached_tokens, r2.pulled_tokens) == (192, 192)
    assert r2.ttft_s == approx(transfer_s(192) + dense_s(8))
    assert sum(r.pulled_tokens for r in records) == 192 and holder.pulled_tokens == 0
    keys = block_hashes(SHARED)
    # Both pools now hold the prefix, and so does the router's index for both workers.
    for worker in sim.front:
        assert all(worker.kv.pool.lookup(k) is not None for k in keys), worker.index
    sim.router.pull()
    assert sorted(m.num_blocks for m in run_now(sim.router.index.match(keys))) == [12, 12]
    # The pull's transfer fed the planner's link model, as a finished pull feeds the router's.
    assert sim.router.planner.pull_cost.num_samples == 1


def test_without_pulls_the_same_request_computes_its_whole_prompt():
    _, records = _run("never")
    r2 = records[2]
    assert (r2.cached_tokens, r2.pulled_tokens) == (0, 0)
    assert r2.ttft_s == approx(dense_s(200))


def test_no_block_stays_pinned_after_pulls():
    requests = [SimRequest(i * 0.002, 200 + 40 * (i % 3), 1 + i % 4, SHARED[: 6 + i % 7]) for i in range(60)]
    for mode in ("always", "auto"):
        sim = Simulation(SimConfig(prefill=3, decode=1, prefix_pull=mode, prefill_kv_tokens=2048), linear_profile())
        result = sim.run(requests)
        assert all(r.status == "ok" for r in result.records), mode
        for worker in sim.front:
            worker.kv.check_integrity()
            assert worker.kv.num_free_blocks == worker.kv.num_blocks, (mode, worker.index)
        assert sim.router.queued == [0, 0, 0] and sim.router.inflight == [0, 0, 0]
        assert all(r.pulled_tokens <= r.cached_tokens for r in result.records)
        if mode == "always":
            assert any(r.pulled_tokens for r in result.records)


def test_an_unknown_pull_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="prefix_pull: must be one of"):
        SimConfig(prefix_pull="sometimes")
