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
                               "--handoff-prompt", "40", "--repeats", "2", "--int8-self-draft"])
    for rows in results["batches"].values():
        assert set(rows) == {"plain", "ngram", "ngram-forced", "draft", "draft-forced", "int8-self",
                             "int8-self-forced"}
        assert all(len(row["tpot_ms_runs"]) == 2 for row in rows.values())
        assert all(row["exact"] for row in rows.values())
        assert rows["ngram-forced"]["spec_step_share"] == 1.0
    assert results["handoff"]["draft_kv_bytes"] > 0 and results["handoff"]["draft_catch_up_ms"] > 0
    assert "x plain" in capsys.readouterr().out
