"""The prefix-routing benchmark: exact hit rates on a constructed trace, the oracle as an upper bound,
the simulator's prefix index equal to its pools after a replay, and the CLI on a slice of the real
Mooncake trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_prefix_routing import (
    DEFAULT_TRACE,
    POLICIES,
    Fleet,
    main,
    oracle_cached_tokens,
    pooled_cached_tokens,
    replay,
)
from engine.block_hash import HashNamespace, hash_blocks
from sim import SimRequest
from sim.drive import run_now
from sim.simulator import Simulation

BLOCK_SIZE = 4
NS = HashNamespace("bench-test", BLOCK_SIZE)
TURN_TOKENS = (8, 16, 24)  # each turn's prompt extends the previous one (a growing conversation)


def request(arrival_s: float, tokens: list[int]) -> SimRequest:
    return SimRequest(arrival_s, len(tokens), 1, tuple(hash_blocks(NS, tokens)))


def conversations(count: int = 3, spacing_s: float = 1.0) -> list[SimRequest]:
    """`count` conversations of len(TURN_TOKENS) turns, interleaved turn by turn, `spacing_s` apart.

    Conversation c's tokens start with 1000 * (c + 1), so no two conversations share a block.
    """
    requests = []
    for length in TURN_TOKENS:
        for c in range(count):
            requests.append(request(len(requests) * spacing_s, list(range(1000 * (c + 1), 1000 * (c + 1) + length))))
    return requests


def test_sticky_policies_hit_every_earlier_turn_exactly_and_round_robin_none():
    requests = conversations()
    fleet = Fleet(num_workers=4, blocks_per_worker=64, block_size=BLOCK_SIZE, prefill_tokens_per_s=1e6)
    # The second turn (16 tokens) finds the first's 2 blocks; the third (24 tokens) finds the second's 4: 8 + 16 of 48.
    expected_cached = 3 * (8 + 16)
    prompt_tokens = 3 * sum(TURN_TOKENS)
    assert oracle_cached_tokens(requests, BLOCK_SIZE) == expected_cached
    rates = {p: replay(p, requests, fleet) for p in POLICIES}
    assert rates["cache_aware"].cached_tokens == expected_cached
    assert rates["cache_aware"].hit_rate == expected_cached / prompt_tokens
    assert rates["prefix_hash"].cached_tokens == expected_cached
    # Every request finds the fleet idle (a second apart, microseconds of compute): least_loaded sends all
    # of them to prefill-0 (ties go to the smallest id), which holds every earlier turn.
    assert rates["least_loaded"].cached_tokens == expected_cached
    # 9 requests in turn over 4 workers: no turn lands where its conversation's previous turn ran.
    assert rates["round_robin"].cached_tokens == 0
    assert all(r.prompt_tokens == prompt_tokens and r.num_requests == 9 for r in rates.values())


def test_the_oracle_bounds_every_policy_when_small_pools_evict():
    requests = conversations(count=6, spacing_s=0.001)  # arrivals faster than prefills: queues form
    fleet = Fleet(num_workers=2, blocks_per_worker=8, block_size=BLOCK_SIZE, prefill_tokens_per_s=1000.0)
    oracle = oracle_cached_tokens(requests, BLOCK_SIZE)
    for policy in POLICIES:
        result = replay(policy, requests, fleet)
        assert result.cached_tokens <= oracle, policy
        assert result.num_requests == len(result.ttfts_s) == len(requests)  # every request served
        # queued: some request waited beyond its own compute (at most 24 tokens: 24 ms)
        assert max(result.ttfts_s) > 0.024, policy
    assert pooled_cached_tokens(requests, 16, BLOCK_SIZE) <= oracle


def test_the_index_ends_equal_to_what_the_pools_cache():
    requests = conversations(count=5)
    fleet = Fleet(num_workers=3, blocks_per_worker=10, block_size=BLOCK_SIZE, prefill_tokens_per_s=1e6)
    sim = Simulation(fleet.config("cache_aware"), fleet.profile())
    sim.run(requests)
    sim.router.pull()  # the events since the last routing choice
    run_now(sim.router.index.check_integrity())
    for r in requests:
        matches = {m.worker_id: m.num_blocks for m in run_now(sim.router.index.match(r.block_keys))}
        for worker in sim.front:
            pool_blocks = 0
            while pool_blocks < len(r.block_keys) and worker.kv.pool.lookup(r.block_keys[pool_blocks]) is not None:
                pool_blocks += 1
            assert matches.get(f"prefill-{worker.index}", 0) == pool_blocks, (r, worker.index)


def test_a_busy_holder_makes_cache_aware_route_away():
    prefix = list(range(500, 516))  # 4 blocks, computed first by r0
    requests = [request(0.0, prefix + [1, 2])]
    for i in range(4):  # a burst sharing the prefix: 8 uncached tokens each on the holder, 24 elsewhere
        requests.append(request(1.0 + 0.0001 * i, prefix + list(range(600 + 10 * i, 608 + 10 * i))))
    fleet = Fleet(num_workers=2, blocks_per_worker=64, block_size=BLOCK_SIZE, prefill_tokens_per_s=100.0)
    result = replay("cache_aware", requests, fleet)
    # Holder costs 8, 16, 24 (a tie with 24 elsewhere: the longer prefix wins), then 32 > 24: b3 goes to the
    # idle worker, which computes all 24 tokens.
    assert result.cached_tokens == 3 * 16


def test_with_pulls_the_worker_routed_away_pulls_the_busy_holders_prefix():
    prefix = list(range(500, 516))
    requests = [request(0.0, prefix + [1, 2])]
    for i in range(4):
        requests.append(request(1.0 + 0.0001 * i, prefix + list(range(600 + 10 * i, 608 + 10 * i))))
    fleet = Fleet(num_workers=2, blocks_per_worker=64, block_size=BLOCK_SIZE, prefill_tokens_per_s=100.0)
    result = replay("cache_aware", requests, fleet, prefix_pull="always")
    assert result.policy == "cache_aware with pulls"
    # As without pulls, b3 goes to the idle worker; it pulls the holder's 4 blocks (the prefix; 5 blocks
    # of its 24 tokens could come from cache) and computes only its 8 own tokens: 16 more cached tokens.
    assert result.cached_tokens == 4 * 16
    assert (result.pulled_tokens, result.pulled_requests) == (16, 1)
    # b3 waits for the pull (5 ms + 16 tokens x 24,576 bytes at 2.5 GB/s), then computes 8 tokens at 100/s.
    assert result.ttfts_s[4] == pytest.approx(0.005 + 16 * 24_576 / 2.5e9 + 8 / 100.0, rel=1e-9)
    assert replay("cache_aware", requests, fleet).ttfts_s[4] == pytest.approx(24 / 100.0, rel=1e-9)


SHIPPED_SLICE = Path(__file__).resolve().parents[1] / "data/traces/mooncake-fast25/conversation_trace.jsonl"


def test_cli_replays_a_slice_of_the_real_trace(capsys):
    trace = DEFAULT_TRACE if DEFAULT_TRACE.is_file() else SHIPPED_SLICE
    main(["--trace", str(trace), "--requests", "100", "--blocks-per-worker", "1024"])
    out = capsys.readouterr().out
    assert f"rows read {sum(1 for _ in trace.open())}, used 100" in out
    rates = {
        line.split(" | ")[0]: float(line.split(" | ")[1])
        for line in out.splitlines()
        if line.count(" | ") == 5 and not line.startswith(("policy", "---"))
    }
    assert set(POLICIES) < set(rates)
    oracle = rates["oracle (infinite cache)"]
    assert all(0 < rate <= oracle for rate in rates.values())
    assert out.count("target cache_aware") == 2
