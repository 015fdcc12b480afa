"""validate_sim's report on hand-checked figures: the comparison against the validation bounds, runs
pooled (one latency sample, goodput averaged) and the count of rows within target."""
from __future__ import annotations

import pytest

from benchmarks.validate_sim_report import compare, pooled_summary, within_counts
from loadtest.records import RequestRecord


def _record(index: int, ttft_s: float, gap_s: float, tokens: int = 3, ok: bool = True) -> RequestRecord:
    times = tuple(ttft_s + gap_s * i for i in range(tokens))
    return RequestRecord(f"r{index}", index, 0.0, 0.0, 10, tokens, times, times[-1], 0,
                         "length" if ok else None, None if ok else "UNAVAILABLE", None)


def _summary(ttft_p50, ttft_p99, tpot_p50, tpot_p99, goodput):
    return {"ttft_ms": {"p50": ttft_p50, "p99": ttft_p99}, "tpot_ms": {"p50": tpot_p50, "p99": tpot_p99},
            "goodput_per_s": goodput}


def test_compare_holds_each_figure_to_its_bound():
    measured = _summary(100.0, 200.0, 10.0, 20.0, 4.0)
    row = compare(measured, _summary(114.0, 261.0, 8.4, 14.2, 3.45))  # +14%, +30.5%, -16%, -29%, -14%
    assert [row[k]["within"] for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "goodput")] == [
        True, False, False, True, True]
    assert row["ttft_p99"]["error"] == pytest.approx(0.305)
    assert compare(_summary(None, 0.0, 10.0, 20.0, 4.0), measured)["ttft_p50"]["within"] is False  # nothing measured


def test_runs_pool_into_one_latency_sample_and_a_mean_goodput():
    first = [_record(0, 0.010, 0.004), _record(1, 0.030, 0.006)]
    second = [_record(0, 0.020, 0.008), _record(1, 0.050, 0.002), _record(2, 9.0, 9.0, ok=False)]
    pooled = pooled_summary([(first, {"goodput_per_s": 2.0}), (second, {"goodput_per_s": 1.0})])
    assert pooled["ttft_ms"]["p50"] == pytest.approx(25.0)  # of 10, 20, 30, 50 ms (the failed one left out)
    assert pooled["tpot_ms"]["p50"] == pytest.approx(5.0)  # of 2, 4, 6, 8 ms
    assert pooled["ttft_ms"]["count"] == 4 and pooled["goodput_per_s"] == pytest.approx(1.5)
    assert pooled["requests_measured"] == 5
    alone = {"goodput_per_s": 2.0, "ttft_ms": {"p50": 20.0}}
    assert pooled_summary([(first, alone)]) is alone  # one run: its own summary, as the bench wrote it


def test_within_counts_reads_rows_or_one_comparison_of_each():
    good = compare(_summary(100.0, 200.0, 10.0, 20.0, 4.0), _summary(100.0, 200.0, 10.0, 20.0, 4.0))
    bad = compare(_summary(100.0, 200.0, 10.0, 20.0, 4.0), _summary(200.0, 400.0, 20.0, 40.0, 8.0))
    rows = [{**good, "noise_floor": bad}, {**bad, "noise_floor": bad}, {**good}]
    assert within_counts(rows) == {"ttft_p50": 2, "ttft_p99": 2, "tpot_p50": 2, "tpot_p99": 2, "goodput": 2}
    assert within_counts(rows, "noise_floor") == dict.fromkeys(("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
                                                                 "goodput"), 0)


def test_resimulation_takes_only_numeric_simconfig_fields_and_needs_the_runs(tmp_path):
    from benchmarks.resimulate_validation import measured_runs, parse_overrides, resimulate

    assert parse_overrides(["host_stream_interference=2.5", "host_background_cores=0.4"]) == {
        "host_stream_interference": 2.5, "host_background_cores": 0.4}
    for bad in ("no_such_field=1", "host_stream_interference", "host_cores=two"):
        with pytest.raises(ValueError):
            parse_overrides([bad])
    with pytest.raises(ValueError, match="records.jsonl"):
        measured_runs(tmp_path)
    with pytest.raises(ValueError, match="settings"):  # a report from before the settings were recorded
        resimulate({"rows": [], "calibrations": [], "profile": {}}, str(tmp_path))


def test_engine_busy_sets_the_runs_mean_beside_the_simulation():
    from types import SimpleNamespace

    from benchmarks.engine_busy import PoolSteps
    from benchmarks.validate_sim_report import engine_busy

    later, earlier = PoolSteps(5.0, 120), PoolSteps(1.5, 20)
    assert later.minus(earlier) == PoolSteps(3.5, 100)
    runs = [{"prefill": PoolSteps(2.0, 10), "decode": PoolSteps(4.0, 300)},
            {"prefill": PoolSteps(3.0, 14), "decode": PoolSteps(5.0, 320)}]
    result = SimpleNamespace(busy_s={"prefill": 2.2, "decode": 4.1}, steps={"prefill": 11, "decode": 305})
    assert engine_busy(runs, result) == {
        "prefill": {"measured_s": 2.5, "simulated_s": 2.2, "measured_steps": 12.0, "simulated_steps": 11},
        "decode": {"measured_s": 4.5, "simulated_s": 4.1, "measured_steps": 310.0, "simulated_steps": 305},
    }
