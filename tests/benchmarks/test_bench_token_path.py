"""bench_token_path without starting clusters: its arguments, the engine arm (a subprocess on a checkout, whose
greedy tokens must equal HF's), the engine summary, and its committed report."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks import bench_token_path as bench
from tests.factories import TinySpec, hf_greedy_generate

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "docs/perf/token_path/cpu.json"


def test_arguments_are_checked_naming_the_flag(capsys, tmp_path):
    args = bench.parse_args([])
    assert args.arms == {"current": str(REPO)} and args.levels == [1, 16] and (args.output, args.rounds) == (64, 3)
    assert bench.parse_args(["--arm", f"a={REPO}", "--arm", f"b={REPO}"]).arms == {"a": str(REPO), "b": str(REPO)}
    for bad, flag in (
        (["--arm", str(REPO)], "--arm"),  # no label
        (["--arm", f"x={tmp_path}"], "--arm"),  # not a checkout of this repository
        (["--concurrency", "1,zero"], "--concurrency"),
        (["--concurrency", "0"], "--concurrency"),
        (["--output", "1"], "--output"),
        (["--rounds", "0"], "--rounds"),
        (["--idle-s", "0"], "--idle-s"),
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert flag in capsys.readouterr().err


def test_the_engine_arm_steps_a_checkout_and_gives_hf_greedy_tokens(checkpoint):
    model_dir = checkpoint(TinySpec())
    got = bench.engine_step(str(REPO), str(model_dir), output=6)
    assert set(got) == {str(b) for b in bench.ENGINE_BATCHES}
    (expected,) = hf_greedy_generate(model_dir, [list(range(5, 45))], 6)
    for batch in got.values():
        assert batch["tokens"] == expected[1:]  # the first token comes from the prefill step, not timed
        assert batch["step_cpu_ms"] > 0


def test_the_engine_summary_pairs_rounds_and_compares_tokens():
    def run(ms: float, tokens: list[int]) -> dict:
        return {str(b): {"step_cpu_ms": ms * b, "tokens": tokens} for b in bench.ENGINE_BATCHES}

    steps = {"a": [run(2.0, [1, 2]), run(4.0, [1, 2])], "b": [run(1.0, [1, 2]), run(3.0, [1, 2])]}
    summary = bench.engine_summary(steps, ["a", "b"])
    assert summary["tokens_equal_across_arms_and_rounds"] is True
    assert summary["b"]["1"]["step_cpu_ms_x_first_arm_per_round"] == [0.5, 0.75]
    assert summary["b"]["1"]["step_cpu_ms"] == 2.0 and summary["a"]["8"]["step_cpu_ms_x_first_arm"] == 1.0
    steps["b"][1]["8"]["tokens"] = [1, 3]
    assert bench.engine_summary(steps, ["a", "b"])["tokens_equal_across_arms_and_rounds"] is False


def test_the_committed_report_is_consistent():
    report = json.loads(REPORT.read_text())
    arms = report["arms"]
    assert arms[0] == "before" and "after" in arms
    assert report["engine_step"]["tokens_equal_across_arms_and_rounds"] is True
    assert len(report["load_average_1min_per_round"]) == report["settings"]["rounds"]
    for level, rows in report["results"].items():
        assert int(level) in (1, 16) and set(rows) == set(arms)
        for row in rows.values():
            parts = sum(row[f"{role}_cpu_ms_per_token"] for role in bench.ROLES)
            assert row["cpu_ms_per_token"] == pytest.approx(parts, rel=0.2)  # medians of sums vs sums of medians
            for key in ("output_tok_s", "tpot_p50_ms", "cpu_ms_per_token"):
                ratios = row[f"{key}_x_first_arm_per_round"]
                assert len(ratios) == report["settings"]["rounds"]
                assert row[f"{key}_x_first_arm"] == statistics.median(ratios)
        assert all(r == 1.0 for r in rows[arms[0]]["output_tok_s_x_first_arm_per_round"])
    assert set(report["idle_cpu_ms_per_s"]) == set(arms)
