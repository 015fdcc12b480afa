"""The KV-store hit-rate replay: exact tier attribution on a constructed trace (a prompt seen before a
restart is a store hit after it, never a pool or host one), and the replay on the slice of the real
Mooncake trace stays under the oracle with its tiers adding up."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks.bench_kv_store_hit_rate import ARMS, TRACE_BLOCK_TOKENS, _oracle, _redis_server, replay
from loadtest.trace_rows import TraceRow, read_trace

pytestmark = pytest.mark.timeout(120)
SLICE = Path(__file__).parents[1] / "data" / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"


def _args(**overrides) -> Namespace:
    values = {"workers": 1, "pool_blocks": 64, "host_blocks": 64, "warmup": 0, "restart_at": 1}
    return Namespace(**{**values, "restart_every": 1, "after_restart": 1, **overrides})


def test_a_prompt_seen_before_a_restart_comes_from_the_store_after_it():
    prompt = TraceRow(0.0, 4 * TRACE_BLOCK_TOKENS + 7, 1, (0, 1, 2, 3, 4))
    rows = [prompt, prompt]  # the worker restarts empty between the two
    expected_store = 4 * TRACE_BLOCK_TOKENS / prompt.input_length
    with _redis_server(8 << 20) as (url, _):
        for arm in ARMS:
            result = replay(_args(), rows, arm, True, url if arm == "pools+host+store" else None)
            window = result["after_restart_window"]
            assert (window["from_pool"], window["from_host"]) == (0.0, 0.0), arm
            assert window["from_store"] == (round(expected_store, 4) if arm == "pools+host+store" else 0.0)
        steady = replay(_args(), rows, "pools", False, None)["after_restart_window"]
        assert steady["from_pool"] == round(expected_store, 4)  # no restart: the pool still holds it


def test_the_replay_on_the_trace_slice_stays_under_the_oracle():
    rows = list(read_trace(SLICE, "mooncake").rows[:200])
    args = _args(workers=2, pool_blocks=96, host_blocks=1024, warmup=50, restart_at=100, restart_every=10)
    oracle = _oracle(rows, args.warmup)
    with _redis_server(4 << 20) as (url, _):
        for arm in ARMS:
            got = replay(args, rows, arm, False, url if arm == "pools+host+store" else None)["all_after_warmup"]
            parts = got["from_pool"] + got["from_host"] + got["from_store"]
            assert got["hit_rate"] <= oracle and parts == pytest.approx(got["hit_rate"], abs=2e-4)
            assert (got["from_host"] > 0) == (arm != "pools") and (got["from_store"] > 0) == (arm == ARMS[-1])
