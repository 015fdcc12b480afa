"""Summary maths on hand-made records: exact percentiles, goodput, attainment, errors, prefix hits."""
from __future__ import annotations

import json

import pytest

from loadtest.records import RequestRecord, read_jsonl, write_jsonl
from loadtest.runner import sweep_report
from loadtest.stats import Distribution, percentile
from loadtest.summary import format_table, reason_key, summarize

SLO = dict(ttft_slo_ms=150.0, tpot_slo_ms=200.0)


def rec(i, send_s, token_times_s, e2e_s, cached, prompt, finish="length", code=None, reason=None) -> RequestRecord:
    return RequestRecord(f"r{i}", i, send_s, send_s, prompt, 8, tuple(token_times_s), e2e_s, cached, finish,
                         code, reason, **SLO)


RECORDS = [
    rec(0, 0.0, (0.1, 0.2, 0.2, 0.4), 0.5, 16, 32),  # TTFT 100, TPOT 100: met
    rec(1, 1.0, (0.3, 0.5), 0.6, 0, 64),  # TTFT 300 > 150: completed, not met
    rec(2, 1.5, (), 0.01, None, 20, None, "RESOURCE_EXHAUSTED", "estimated TTFT 812 ms exceeds 150 ms"),
    rec(3, 2.0, (), 0.02, None, 20, None, "RESOURCE_EXHAUSTED", "estimated TTFT 1.5e3 ms exceeds 150 ms"),
    rec(4, 2.5, (0.2,), 0.7, 32, 32, None, "UNAVAILABLE", "worker lost"),
    rec(5, 3.0, (0.05,), 0.1, 0, 10),  # one token: TPOT not judged; met
]


def test_percentiles_interpolate_between_ranks():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([50.0, 100.0, 300.0], 99) == pytest.approx(296.0)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    assert Distribution.of([]) == Distribution(0, None, None, None, None, None)


def test_derived_latencies_of_a_record():
    r0 = RECORDS[0]
    assert (r0.ttft_s, r0.tpot_s, r0.output_tokens, r0.end_s) == (0.1, pytest.approx(0.1), 4, 0.5)
    assert r0.itl_s == pytest.approx((0.05, 0.05, 0.2))  # the 2-token message shares its 0.1 s gap
    assert sum(r0.itl_s) == pytest.approx(0.4 - 0.1)
    first_chunk_of_three = rec(9, 0.0, (0.1, 0.1, 0.1, 0.3), 0.3, 0, 4)
    assert first_chunk_of_three.itl_s == pytest.approx((0.0, 0.0, 0.2))
    assert [r.met_slo for r in RECORDS] == [True, False, False, False, False, True]
    assert RECORDS[4].tpot_s is None and RECORDS[4].ttft_s == 0.2 and not RECORDS[4].ok
    unjudged = RequestRecord("u", 0, 0.0, 0.0, 4, 8, (9.0, 19.0), 20.0, 0, "stop", None, None)
    assert unjudged.met_slo


def test_summary_figures_are_exact():
    s = summarize(RECORDS, workload="poisson", planned=8, notes={"k": 1})
    assert (s.requests_planned, s.requests_not_issued, s.requests_measured) == (8, 2, 6)
    assert (s.requests_completed, s.requests_failed, s.duration_s) == (3, 3, pytest.approx(3.2))
    assert s.request_throughput_per_s == pytest.approx(3 / 3.2)
    assert s.goodput_per_s == pytest.approx(2 / 3.2)
    assert s.output_token_throughput_per_s == pytest.approx(8 / 3.2)
    assert s.slo_attainment == pytest.approx(2 / 6)
    # TTFTs 50, 100, 300 ms: median = p50; std is the population's (as vllm bench serve reports it)
    assert s.ttft_ms == Distribution(3, pytest.approx(150), pytest.approx(100), pytest.approx(260),
                                     pytest.approx(296), pytest.approx(300), pytest.approx(100),
                                     pytest.approx((35000 / 3) ** 0.5))
    assert (s.tpot_ms.count, s.tpot_ms.p50, s.tpot_ms.p90) == (2, pytest.approx(150), pytest.approx(190))
    assert (s.itl_ms.count, s.itl_ms.mean, s.itl_ms.p50, s.itl_ms.p90) == (4, pytest.approx(125), pytest.approx(125),
                                                                            pytest.approx(200))
    assert (s.e2e_ms.p50, s.e2e_ms.mean) == (pytest.approx(500), pytest.approx(400))
    assert s.errors == {"RESOURCE_EXHAUSTED: estimated TTFT N ms exceeds N ms": 2, "UNAVAILABLE: worker lost": 1}
    assert s.rejection_rate == pytest.approx(2 / 6)
    assert (s.cached_prompt_tokens, s.prompt_tokens) == (48, 138)
    assert s.prefix_hit_rate == pytest.approx(48 / 138)
    assert s.slo == {"ttft_ms": 150.0, "tpot_ms": 200.0} and s.notes == {"k": 1}


def test_goodput_is_recomputable_from_the_records_file(tmp_path):
    path = write_jsonl(RECORDS, tmp_path / "out" / "records.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["met_slo"] for row in rows] == [r.met_slo for r in RECORDS]
    assert rows[0]["itl_s"] == pytest.approx([0.05, 0.05, 0.2]) and rows[0]["ttft_s"] == 0.1
    back = read_jsonl(path)
    assert back == RECORDS
    span_s = max(r["send_s"] + r["e2e_s"] for r in rows) - min(r["send_s"] for r in rows)
    goodput = sum(r["finish_reason"] is not None and r["error_code"] is None and r["met_slo"] for r in rows) / span_s
    assert summarize(back, workload="x", planned=6).goodput_per_s == pytest.approx(goodput)


def test_warmup_requests_are_run_but_not_measured():
    s = summarize(RECORDS, workload="poisson", planned=6, warmup_s=1.0)
    assert (s.requests_warmup, s.requests_measured, s.requests_completed) == (1, 5, 2)
    assert s.duration_s == pytest.approx(3.2 - 1.0)
    assert s.slo_attainment == pytest.approx(1 / 5)


def test_empty_run_and_error_keys():
    s = summarize([], workload="poisson", planned=3)
    assert (s.requests_not_issued, s.duration_s, s.goodput_per_s, s.slo_attainment, s.prefix_hit_rate) == \
        (3, 0.0, None, None, None)
    assert "poisson" in format_table(s)
    assert reason_key("CANCELLED", None) == "CANCELLED"
    assert reason_key("RESOURCE_EXHAUSTED", "queue 12 > 8") == "RESOURCE_EXHAUSTED: queue N > N"


def test_table_shows_the_headline_figures():
    table = format_table(summarize(RECORDS, workload="poisson", planned=6, rate_per_s=2.0))
    assert "poisson @ 2.0 req/s" in table
    assert "attainment 33.3%  goodput 0.62 req/s" in table
    assert "prefix hit rate 34.8% (48/138 prompt tokens)" in table
    assert "TTFT              150.00    108.01    100.00    260.00    296.00    300.00       3" in table
    assert "       2  RESOURCE_EXHAUSTED: estimated TTFT N ms exceeds N ms" in table


def test_sweep_report_names_the_highest_rate_meeting_the_target():
    at = {rate: summarize(RECORDS[:k], workload="p", planned=k, rate_per_s=rate)
          for rate, k in ((1.0, 1), (2.0, 2), (4.0, 6))}  # attainment 1.0, 0.5, 0.33
    report = sweep_report([(4.0, at[4.0]), (1.0, at[1.0]), (2.0, at[2.0])], 0.5)
    assert report["max_rate_meeting_target"] == 2.0
    assert [p["rate_per_s"] for p in report["points"]] == [1.0, 2.0, 4.0]
    assert sweep_report([(4.0, at[4.0])], 0.9)["max_rate_meeting_target"] is None
