"""The trace parsers and the trace workload on the slices shipped in tests/data/traces (always present)."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.trace import TOO_LONG, TraceSpec
from loadtest.trace_rows import TraceRow, detect_format, read_trace
from tests.loadtest.helpers import LIMITS, all_tokens_valid
from loadtest.plan import RequestDefaults

SLICES = Path(__file__).resolve().parents[1] / "data" / "traces"
CONVERSATION = SLICES / "mooncake-fast25" / "conversation_trace.jsonl"
AZURE = SLICES / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_conv.csv"


@pytest.mark.parametrize("path, fmt, first, last_arrival_s", [
    (CONVERSATION, "mooncake", TraceRow(0.0, 6758, 500, tuple(range(14))), 102.0),
    (AZURE, "azure", TraceRow(0.0, 374, 44, None), 84.029102),
])
def test_slices_parse_completely(path, fmt, first, last_arrival_s):
    trace = read_trace(path)
    assert (trace.format, len(trace.rows), trace.dropped, trace.rows_read) == (fmt, 300, {}, 300)
    assert trace.rows[0] == first and detect_format(path) == fmt
    assert trace.rows[-1].arrival_s == pytest.approx(last_arrival_s, abs=1e-3)


def test_conversation_slice_replays_within_the_model_with_drops_reported():
    plan = TraceSpec(str(CONVERSATION)).build(LIMITS, RequestDefaults(), seed=0)
    notes = plan.notes
    assert notes["rows_read"] == 300
    assert notes["rows_planned"] + notes["rows_dropped"].get(TOO_LONG, 0) == 300
    assert len(plan.requests) == notes["rows_planned"] > 0 and all_tokens_valid(plan)
    assert len({r.prompt_token_ids[:16] for r in plan.requests}) == 1  # every row starts with hash id 0
