"""The prefix-routing benchmark: exact hit rates on a constructed trace, the oracle as an upper bound,
pools and index consistent after a replay, and the CLI on a slice of the real Mooncake trace."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
from pathlib import Path

import pytest

from benchmarks.bench_prefix_routing import DEFAULT_TRACE, POLICIES, main, oracle_cached_tokens, pooled_cached_tokens
from benchmarks.prefill_sim import PrefillReplay, SimConfig, SimRequest
from engine.block_hash import HashNamespace, hash_blocks

BLOCK_SIZE = 4
NS = HashNamespace("bench-test", BLOCK_SIZE)
TURN_TOKENS = (8, 16, 24)  # each turn's prompt extends the previous one (a growing conversation)


def conversations(count: int = 3, spacing_s: float = 1.0) -> list[SimRequest]:
    """`count` conversations of len(TURN_TOKENS) turns, interleaved turn by turn, `spacing_s` apart.

    Conversation c's tokens start with 1000 * (c + 1), so no two conversations share a block.
    """
    requests = []
    for turn, length in enumerate(TURN_TOKENS):
        for c in range(count):
            tokens = list(range(1000 * (c + 1), 1000 * (c + 1) + length))
            requests.append(SimRequest(f"c{c}t{turn}", len(requests) * spacing_s, np.array(tokens, dtype=np.uint32),
                                       tuple(hash_blocks(NS, tokens))))
    return requests


def replay(policy: str, requests: list[SimRequest], config: SimConfig) -> PrefillReplay:
    async def go() -> PrefillReplay:
        run = PrefillReplay(policy, config)
        await run.run(requests)
        await run.check_integrity()  # every pool, table, the index and the policy
        return run

    return asyncio.run(go())


def test_sticky_policies_hit_every_earlier_turn_exactly_and_round_robin_none():
    requests = conversations()
    config = SimConfig(num_workers=4, blocks_per_worker=64, block_size=BLOCK_SIZE, prefill_tokens_per_s=1e6)
    # Turn 2 (16 tokens) finds turn 1's 2 blocks; turn 3 (24 tokens) finds turn 2's 4 blocks: 8 + 16 of 48.
    expected_cached = 3 * (8 + 16)
    prompt_tokens = 3 * sum(TURN_TOKENS)
    assert oracle_cached_tokens(requests, BLOCK_SIZE) == expected_cached
    rates = {p: replay(p, requests, config).result for p in POLICIES}
    assert rates["cache_aware"].cached_tokens == expected_cached
    assert rates["cache_aware"].hit_rate == pytest.approx(expected_cached / prompt_tokens)
    assert rates["prefix_hash"].cached_tokens == expected_cached
    # 9 requests in turn over 4 workers: no turn lands where its conversation's previous turn ran.
    assert rates["round_robin"].cached_tokens == 0
    # ... although the index showed each earlier turn on the worker that ran it, a second before.
    assert rates["round_robin"].routed_away_tokens == expected_cached
    assert rates["cache_aware"].routed_away_tokens == rates["prefix_hash"].routed_away_tokens == 0
    assert all(r.prompt_tokens == prompt_tokens and r.num_requests == 9 for r in rates.values())


def test_the_oracle_bounds_every_policy_when_small_pools_evict():
    requests = conversations(count=6, spacing_s=0.001)  # arrivals faster than prefills: queues form
    config = SimConfig(num_workers=2, blocks_per_worker=8, block_size=BLOCK_SIZE, prefill_tokens_per_s=1000.0)
    oracle = oracle_cached_tokens(requests, BLOCK_SIZE)
    for policy in POLICIES:
        result = replay(policy, requests, config).result
        assert result.cached_tokens <= oracle, policy
        assert result.mean_queue_delay_s > 0 and sum(result.computed_tokens_by_worker.values()) == (
            result.prompt_tokens - result.cached_tokens)
    assert pooled_cached_tokens(requests, 16, BLOCK_SIZE) <= oracle


def test_the_index_ends_equal_to_what_the_pools_cache():
    requests = conversations(count=5)
    config = SimConfig(num_workers=3, blocks_per_worker=10, block_size=BLOCK_SIZE, prefill_tokens_per_s=1e6)
    run = replay("cache_aware", requests, config)
    assert len(run.result.match_latencies_us) == len(requests)
    for request in requests:
        token_ids = request.token_ids.tolist() + [0]  # one more token: find_cached_prefix may use every block
        matches = {m.worker_id: m.num_blocks for m in asyncio.run(run.index.match(request.block_hashes))}
        for worker in run.workers.values():
            pool_blocks = len(worker.kv.find_cached_prefix(token_ids, request.block_hashes).block_ids)
            assert matches.get(worker.worker_id, 0) == pool_blocks, (request.request_id, worker.worker_id)


def test_a_busy_holder_makes_cache_aware_route_away_and_pull_the_prefix():
    prefix = list(range(500, 516))  # 4 blocks, computed first by r0
    requests = [SimRequest("r0", 0.0, np.array(prefix + [1, 2], dtype=np.uint32), tuple(hash_blocks(NS, prefix)))]
    for i in range(4):  # a burst sharing the prefix: 8 uncached tokens each on the holder, 24 elsewhere
        tokens = prefix + list(range(600 + 10 * i, 608 + 10 * i))
        requests.append(SimRequest(f"b{i}", 1.0 + 0.0001 * i, np.array(tokens, dtype=np.uint32),
                                   tuple(hash_blocks(NS, tokens))))
    config = SimConfig(num_workers=2, blocks_per_worker=64, block_size=BLOCK_SIZE, prefill_tokens_per_s=100.0)
    without = replay("cache_aware", requests, config).result
    pulled = replay("cache_aware", requests, dataclasses.replace(config, prefix_pull="always")).result
    # Holder costs 8, 16, 24 (tie with 24 elsewhere: the longer prefix wins), then 32 > 24: b3 goes to the
    # idle worker, which computes all 24 tokens, or pulls the 4 blocks and computes 8.
    assert without.routed_away_tokens == pulled.routed_away_tokens == 16
    assert (without.pulled_tokens, pulled.pulled_tokens) == (0, 16)
    assert pulled.cached_tokens == without.cached_tokens + 16 == 4 * 16
    assert pulled.computed_tokens_by_worker == {"prefill-0": 18 + 24, "prefill-1": 8} or \
        pulled.computed_tokens_by_worker == {"prefill-0": 8, "prefill-1": 18 + 24}


SHIPPED_SLICE = Path(__file__).resolve().parents[1] / "data/traces/mooncake-fast25/conversation_trace.jsonl"


def test_cli_replays_a_slice_of_the_real_trace(capsys):
    trace = DEFAULT_TRACE if DEFAULT_TRACE.is_file() else SHIPPED_SLICE
    main(["--trace", str(trace), "--requests", "100", "--blocks-per-worker", "1024"])
    out = capsys.readouterr().out
    assert f"rows read {sum(1 for _ in trace.open())}, used 100" in out
    rates = {line.split(" | ")[0]: float(line.split(" | ")[1]) for line in out.splitlines()
             if line.count(" | ") == 7 and not line.startswith(("policy", "---"))}
    assert set(POLICIES) < set(rates)
    oracle = rates["oracle (infinite cache)"]
    assert all(0 < rate <= oracle for rate in rates.values())
    assert "index match latency (cache_aware, 100 lookups)" in out
    assert out.count("target cache_aware") == 2
