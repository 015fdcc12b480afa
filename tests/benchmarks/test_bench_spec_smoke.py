"""Smoke test of benchmarks/bench_spec.py on a tiny checkpoint: every arm runs, every arm's greedy
output equals the plain engine's, and the layer-truncated draft is a loadable checkpoint."""
from __future__ import annotations

from benchmarks import bench_spec
from engine.model_loader import load_model_config
from tests.factories import TinySpec


def test_truncated_copy_keeps_the_first_layers(checkpoint, tmp_path):
    model_dir = checkpoint(TinySpec(num_layers=2))
    draft = bench_spec.truncated_copy(model_dir, 1, tmp_path / "draft")
    assert load_model_config(draft).num_layers == 1
    assert (draft / "tokenizer.json").read_text() == (model_dir / "tokenizer.json").read_text()


def test_every_arm_runs_and_is_exact(checkpoint, capsys):
    model_dir = checkpoint(TinySpec(num_layers=2))
    results = bench_spec.main(["--model", str(model_dir), "--batches", "1,3", "--max-tokens", "6",
                               "--text-tokens", "6", "--draft-layers", "1", "--num-kv-blocks", "256",
                               "--handoff-prompt", "40", "--repeats", "2", "--int8-self-draft", "--control"])
    for rows in results["batches"].values():
        assert set(rows) == {"plain", "ngram", "ngram-forced", "draft", "draft-forced", "int8-self",
                             "int8-self-forced", "plain-control"}
        assert all(len(row["tpot_ms_runs"]) == 2 for row in rows.values())
        assert all(row["exact"] for row in rows.values())
        assert rows["ngram-forced"]["spec_step_share"] == 1.0
        assert rows["plain"]["tpot_ratio_paired"] == 1.0 and rows["plain-control"]["tpot_ratio_paired"] > 0
    assert results["handoff"]["draft_kv_bytes"] > 0 and results["handoff"]["draft_catch_up_ms"] > 0
    assert "x plain" in capsys.readouterr().out


def test_each_round_starts_one_arm_later():
    names = ["plain", "ngram", "draft"]
    assert [bench_spec._rotated(names, r) for r in range(4)] == [
        ["plain", "ngram", "draft"], ["ngram", "draft", "plain"], ["draft", "plain", "ngram"], ["plain", "ngram", "draft"]]


def test_the_paired_ratio_is_the_median_of_per_round_ratios():
    rows = {"plain": {"tpot_ms": 2.0, "tokens_per_s": 10.0, "first_round_tpot_ms": 2.0, "tpot_ms_runs": [1.0, 2.0, 4.0]},
            "arm": {"tpot_ms": 2.0, "tokens_per_s": 10.0, "first_round_tpot_ms": 2.0, "tpot_ms_runs": [2.0, 2.0, 2.0]}}
    bench_spec.add_ratios(rows)
    assert rows["arm"]["tpot_ratio"] == 1.0 and rows["arm"]["tpot_ratio_paired"] == 1.0
    rows["arm"]["tpot_ms_runs"] = [0.5, 1.0, 8.0]  # per round: 2.0, 2.0, 0.5
    bench_spec.add_ratios(rows)
    assert rows["arm"]["tpot_ratio_paired"] == 2.0
