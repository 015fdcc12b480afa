"""Trace parsing (shipped Mooncake and Azure files, and malformed rows) and the trace workload."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from loadtest.plan import ModelLimits, RequestDefaults
from loadtest.trace import TOO_LONG, TraceSpec
from loadtest.trace_rows import TraceRow, detect_format, read_trace
from tests.loadtest.helpers import LIMITS, all_tokens_valid

_REPO = Path(__file__).resolve().parents[2]
# shared/ sits beside the checkout (or inside it, on the device machine); SPLITSERVE_TRACES overrides.
_CANDIDATES = [Path(p) for p in (os.environ.get("SPLITSERVE_TRACES"),) if p] + \
    [_REPO.parent / "shared" / "traces", _REPO / "shared" / "traces"]
TRACES = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[-1])
CONVERSATION = TRACES / "mooncake-fast25" / "conversation_trace.jsonl"
SYNTHETIC = TRACES / "mooncake-fast25" / "synthetic_trace.jsonl"
AZURE = TRACES / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_conv.csv"
needs_traces = pytest.mark.skipif(not CONVERSATION.is_file(), reason=f"shipped traces not found under {TRACES}")
DEFAULTS = RequestDefaults()


@needs_traces
@pytest.mark.parametrize("path, fmt, rows, first, last_arrival_s", [
    (CONVERSATION, "mooncake", 12031, TraceRow(0.0, 6758, 500, tuple(range(14))), 3536.999),
    (SYNTHETIC, "mooncake", 3993, TraceRow(0.0, 40160, 6, tuple(range(79))), 1022.025),
    (AZURE, "azure", 19366, TraceRow(0.0, 374, 44, None), 3501.721937),
])
def test_shipped_traces_parse_completely(path, fmt, rows, first, last_arrival_s):
    trace = read_trace(path)
    assert (trace.format, len(trace.rows), trace.dropped, trace.rows_read) == (fmt, rows, {}, rows)
    assert trace.rows[0] == first
    assert trace.rows[-1].arrival_s == pytest.approx(last_arrival_s, abs=1e-3)
    assert detect_format(path) == fmt


def test_malformed_rows_are_dropped_and_counted_by_reason(tmp_path):
    good = {"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [4, 5]}
    lines = [json.dumps({**good, "timestamp": 3000}), "{not json", json.dumps({**good, "hash_ids": [4]}),
             json.dumps({**good, "output_length": 0}), json.dumps({**good, "input_length": "600"}), "",
             json.dumps([1, 2]), json.dumps(good)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    trace = read_trace(path)
    assert trace.rows == (TraceRow(0.0, 600, 3, (4, 5)), TraceRow(1.5, 600, 3, (4, 5)))  # sorted, from first
    assert trace.dropped == {"malformed: not JSON": 1, "malformed: len(hash_ids) != ceil(input_length / 512)": 1,
                             "non-positive input or output length": 1,
                             "malformed: input_length missing or not an integer": 1,
                             "malformed: not a JSON object": 1}
    assert trace.rows_read == 7


def test_azure_rows_and_format_detection(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5000000,10,2\n"
                    "2023-11-16 18:15:48.0000000,20,x\nyesterday,1,1\n2023-11-16 18:15:47.0000000,30,4\n")
    trace = read_trace(path)
    assert trace.rows == (TraceRow(0.0, 10, 2, None), TraceRow(0.5, 30, 4, None))
    assert trace.dropped == {"malformed: token counts not integers": 1, "malformed: bad TIMESTAMP": 1}
    other = tmp_path / "o.txt"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="neither Mooncake"):
        read_trace(other)
    assert read_trace(path, "azure") == trace


def write_mooncake(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> str:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                            for t, i, o, h in rows))
    return str(path)


def test_equal_hash_ids_give_token_identical_blocks(tmp_path):
    path = write_mooncake(tmp_path / "m.jsonl", [(0, 1024, 4, [0, 1]), (1000, 1100, 4, [0, 1, 2]),
                                                 (2000, 700, 4, [0, 3]), (3000, 100, 4, [5])])
    plan = TraceSpec(path).build(LIMITS, DEFAULTS, seed=0)
    p = [r.prompt_token_ids for r in plan.requests]
    # auto scale: one 16-token block per 512-token trace block; lengths x 16/512
    assert [len(x) for x in p] == [32, 34, 22, 3] and [r.max_tokens for r in plan.requests] == [4] * 4
    assert p[1][:32] == p[0] and p[2][:16] == p[0][:16] and p[2][16:] != p[0][16:22]
    assert p[3] != p[0][:3]
    assert all_tokens_valid(plan)
    assert [r.arrival_s for r in plan.requests] == [0.0, 1.0, 2.0, 3.0]
    assert plan == TraceSpec(path).build(LIMITS, DEFAULTS, seed=0)
    assert TraceSpec(path).build(LIMITS, DEFAULTS, seed=1).requests[0].prompt_token_ids != p[0]


def test_rows_over_the_context_are_dropped_or_clipped_and_reported(tmp_path):
    limits = ModelLimits(max_model_len=40, vocab_size=100, block_size=16)
    path = write_mooncake(tmp_path / "m.jsonl", [(0, 1024, 4, [0, 1]), (10, 1024, 9, [0, 1]), (20, 2000, 1, [0, 1, 2, 3])])
    dropped = TraceSpec(path).build(limits, DEFAULTS, seed=0)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in dropped.requests] == [(32, 4)]
    assert dropped.notes["rows_dropped"] == {TOO_LONG: 2} and dropped.notes["rows_clipped"] == 0
    clipped = TraceSpec(path, overflow="clip").build(limits, DEFAULTS, seed=0)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in clipped.requests] == [(32, 4), (32, 8), (39, 1)]
    assert clipped.notes["rows_dropped"] == {} and clipped.notes["rows_clipped"] == 2
    assert clipped.requests[2].prompt_token_ids[:32] == clipped.requests[0].prompt_token_ids


def test_time_and_length_scaling(tmp_path):
    path = write_mooncake(tmp_path / "m.jsonl", [(0, 512, 10, [0]), (1000, 512, 10, [1]), (4000, 512, 10, [2]),
                                                 (5000, 512, 10, [3])])
    fast = TraceSpec(path, speedup=2.0, prompt_scale=0.0625, output_scale=0.5).build(LIMITS, DEFAULTS, seed=0)
    assert [r.arrival_s for r in fast.requests] == [0.0, 0.5, 2.0, 2.5]
    assert {(r.num_prompt_tokens, r.max_tokens) for r in fast.requests} == {(32, 5)}
    targeted = TraceSpec(path, rate_per_s=8.0, num_requests=3).build(LIMITS, DEFAULTS, seed=0)
    # the 3 kept rows span 4 s: 0.75 req/s as recorded (rows / span), so a speed-up of 8 / 0.75
    assert targeted.notes["speedup"] == pytest.approx(8 / 0.75)
    assert [r.arrival_s for r in targeted.requests] == pytest.approx([0.0, 0.09375, 0.375])
    assert targeted.notes["rows_beyond_num_requests"] == 1 and targeted.notes["rows_planned"] == 3
    spread = TraceSpec(path, spread_s=3.0).build(LIMITS, DEFAULTS, seed=0)
    assert spread == TraceSpec(path, spread_s=3.0).build(LIMITS, DEFAULTS, seed=0)
    times = [r.arrival_s for r in spread.requests]
    assert times[0] == 0.0 and times == sorted(times) and times != [0.0, 1.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="whole number"):
        TraceSpec(path, prompt_scale=0.001).build(LIMITS, DEFAULTS, seed=0)


def test_trace_spec_rejects_bad_values(tmp_path):
    path = write_mooncake(tmp_path / "m.jsonl", [(0, 512, 10, [0])])
    for kwargs, flag in [({"speedup": 0.0}, "--trace-speedup"), ({"overflow": "wrap"}, "--trace-overflow"),
                         ({"spread_s": -1.0}, "--trace-spread-s"), ({"trace_format": "csv"}, "--trace-format"),
                         ({"num_requests": 0}, "--num-requests"), ({"output_scale": float("inf")}, "output-scale")]:
        with pytest.raises(ValueError, match=flag):
            TraceSpec(path, **kwargs)
    with pytest.raises(ValueError, match="no such file"):
        TraceSpec(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="all arrive at once"):
        TraceSpec(path, rate_per_s=1.0).build(LIMITS, DEFAULTS, seed=0)
    with pytest.raises(ValueError, match="no row .* fits"):
        TraceSpec(path).build(ModelLimits(max_model_len=12, vocab_size=50, block_size=16), DEFAULTS, seed=0)


@needs_traces
def test_shipped_traces_replay_within_the_model_with_drops_reported():
    conversation = TraceSpec(str(CONVERSATION)).build(LIMITS, DEFAULTS, seed=0)
    notes = conversation.notes
    assert notes["rows_read"] == 12031
    assert notes["rows_planned"] + notes["rows_dropped"][TOO_LONG] == 12031
    assert len(conversation.requests) == notes["rows_planned"] == 4707  # max_model_len 512 drops the rest
    assert all_tokens_valid(conversation)
    # every conversation request starts with hash id 0: one shared first block of 16 tokens
    assert len({r.prompt_token_ids[:16] for r in conversation.requests}) == 1
    first_100 = TraceSpec(str(CONVERSATION), num_requests=100).build(LIMITS, DEFAULTS, seed=0).notes
    assert first_100["rows_planned"] == 100 and first_100["rows_beyond_num_requests"] > 0
    assert 100 + first_100["rows_dropped"][TOO_LONG] + first_100["rows_beyond_num_requests"] == 12031
    azure = TraceSpec(str(AZURE), num_requests=200, rate_per_s=4.0).build(LIMITS, DEFAULTS, seed=0)
    assert len(azure.requests) == 200 and all_tokens_valid(azure)
    assert azure.requests[-1].arrival_s == pytest.approx(200 / 4.0)
    assert azure.notes["rows_beyond_num_requests"] + 200 + sum(azure.notes["rows_dropped"].values()) == 19366
