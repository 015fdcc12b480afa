"""The KV-store hit-rate replay: exact tier attribution on a constructed trace (a prompt seen before a
restart is a store hit after it, never a pool or host one), and the replay on the slice of the real
Mooncake trace stays under the oracle with its tiers adding up."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks.bench_kv_store_hit_rate import ARMS, TRACE_BLOCK_TOKENS, Fleet, _oracle, _redis_server, replay
from loadtest.trace_rows import TraceRow, read_trace
from policies.routing import LoadBook, RouteQuery, WorkerLoad
from sim.drive import run_now
from sim.seq import block_hashes

pytestmark = pytest.mark.timeout(120)
SLICE = Path(__file__).parents[1] / "data" / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"


def _args(**overrides) -> Namespace:
    values = {"workers": 1, "pool_blocks": 64, "host_blocks": 64, "warmup": 0, "restart_at": 1}
    return Namespace(**{**values, "restart_every": 1, "after_restart": 1, **overrides})


def test_a_prompt_seen_before_a_restart_comes_from_the_store_after_it():
    prompt = TraceRow(0.0, 4 * TRACE_BLOCK_TOKENS + 7, 1, (0, 1, 2, 3, 4))
    rows = [prompt, prompt]  # the worker restarts empty between the two
    expected_store = 4 * TRACE_BLOCK_TOKENS / prompt.input_length
    with _redis_server(8 << 20) as (url, client):
        for arm in ARMS:
            client.flushall()
            with_store = ARMS[arm][1]
            result = replay(_args(), rows, arm, True, url if with_store else None)
            window = result["after_restart_window"]
            assert (window["from_pool"], window["from_host"]) == (0.0, 0.0), arm
            assert window["from_store"] == (round(expected_store, 4) if with_store else 0.0)
        steady = replay(_args(), rows, "pools", False, None)["after_restart_window"]
        assert steady["from_pool"] == round(expected_store, 4)  # no restart: the pool still holds it


def test_the_replay_on_the_trace_slice_stays_under_the_oracle():
    rows = list(read_trace(SLICE, "mooncake").rows[:200])
    args = _args(workers=2, pool_blocks=96, host_blocks=1024, warmup=50, restart_at=100, restart_every=10)
    oracle = _oracle(rows, args.warmup)
    with _redis_server(4 << 20) as (url, client):
        hit_rates = {}
        for arm, (_, with_store, _) in ARMS.items():
            client.flushall()  # each arm starts with an empty store, as in the benchmark
            got = replay(args, rows, arm, False, url if with_store else None)["all_after_warmup"]
            parts = got["from_pool"] + got["from_host"] + got["from_store"]
            assert got["hit_rate"] <= oracle and parts == pytest.approx(got["hit_rate"], abs=2e-4)
            assert (got["from_host"] > 0) == (arm != "pools") and (got["from_store"] > 0) == with_store
            hit_rates[arm] = got
    aware, unaware = hit_rates["pools+host, host-aware index"], hit_rates["pools+host"]
    assert aware["from_host"] >= unaware["from_host"]


def _row(arrival_s: float, blocks: tuple[int, ...]) -> TraceRow:
    return TraceRow(arrival_s, len(blocks) * TRACE_BLOCK_TOKENS + 7, 1, blocks)


def _holders(fleet: Fleet, row: TraceRow) -> list[str]:
    assert row.hash_ids is not None
    return [m.worker_id for m in run_now(fleet.index.match(block_hashes(row.hash_ids))) if m.num_blocks]


def test_a_host_aware_index_sends_a_prefix_back_to_the_worker_whose_host_tier_kept_it():
    """Worker x computes A; y computes B, which shares A's first block; x's pool then evicts A (its host
    tier keeps it). A again: an index of pools only sees y holding one block and sends it there; the
    host-aware index sends it to x, which fetches all four blocks from its host tier."""
    served = {}
    for arm in ("pools+host", "pools+host, host-aware index"):
        use_host, _, host_aware = ARMS[arm]
        fleet = Fleet(_args(workers=2, pool_blocks=6), use_host=use_host, store=None, host_aware=host_aware)
        a = _row(0.0, (0, 1, 2, 3))
        assert fleet.serve(a) == (0, 0, 0)
        [x] = _holders(fleet, a)
        assert fleet.serve(_row(0.0, (0, 50, 51))) == (0, 0, 0)  # x is busy with A: y computes it
        [y] = {w.worker_id for w in fleet.workers} - {x}
        assert y in _holders(fleet, _row(0.0, (0,)))
        idle = LoadBook(WorkerLoad(w.worker_id, 0, 0) for w in fleet.workers)
        for n, base in enumerate(range(100, 10_000, 10), 1):  # cold prompts the ring gives x, until A left x's pool
            if x not in _holders(fleet, a):
                break
            fill = _row(float(n), (base, base + 1, base + 2, base + 3))
            keys = block_hashes(fill.hash_ids or ())
            if run_now(fleet.policy.choose(RouteQuery(keys, fill.input_length, TRACE_BLOCK_TOKENS, keys[0]), idle)).worker_id == x:
                fleet.serve(fill)
        assert x not in _holders(fleet, a)
        served[arm] = fleet.serve(_row(1e6, a.hash_ids or ()))
    assert served["pools+host"] == (TRACE_BLOCK_TOKENS, 0, 0)  # y: block 0 from its pool, the rest computed
    assert served["pools+host, host-aware index"] == (0, 4 * TRACE_BLOCK_TOKENS, 0)  # x: all of it from its host tier
