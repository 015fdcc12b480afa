"""Smoke test of `benchmarks.bench_engine`: the whole pipeline on a tiny checkpoint, in a few seconds."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import bench_engine as bench
from engine.kernels import isa


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    # Weights wider than HF's 0.02 default keep the top-1 logit margin far above fp32 reordering noise,
    # so engine and HF agree token for token and a --check failure means a real bug.
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=256, initializer_range=0.25, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2, tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).eval().save_pretrained(out)
    return out


def test_bench_reports_both_throughputs_and_checks_tokens(tiny_model_dir, tmp_path):
    summary_path = tmp_path / "summary.json"
    bench.main(["--model", str(tiny_model_dir), "--num-requests", "6", "--min-prompt", "3", "--max-prompt", "12",
                "--min-output", "2", "--max-output", "6", "--hf-batch-sizes", "1,2", "--calibration-requests", "4",
                "--hf-sample", "6", "--check", "6", "--threads", "1", "--json", str(summary_path)])
    summary = json.loads(summary_path.read_text())
    engine, hf = summary["engine"], summary["hf"]
    assert engine["num_requests"] == 6 and hf["num_requests"] == 6
    assert engine["output_tokens"] == hf["output_tokens"] > 0  # same requests, same useful tokens
    assert engine["output_tokens_per_s"] > 0 and hf["output_tokens_per_s"] > 0
    assert summary["ratio"] == pytest.approx(engine["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert hf["batch_size"] in (1, 2)
    assert [row["batch_size"] for row in summary["calibration"]] == [1, 2]
    assert summary["check"] == {"num_requests": 6, "num_identical": 6, "first_divergence_by_request": {},
                                "passed": True}
    # The decode-attention kernel ran in the best instruction-set variant this CPU supports.
    assert summary["kernel_variants"]["paged_decode_attention"] == isa.supported_variants()[0].name


def test_bench_profile_mode_attributes_time_to_engine_files(tiny_model_dir, tmp_path, capsys):
    summary = bench.main(["--model", str(tiny_model_dir), "--num-requests", "4", "--max-prompt", "20",
                          "--min-prompt", "4", "--min-output", "2", "--max-output", "4", "--profile",
                          "--profile-requests", "3", "--threads", "1"])
    assert summary["profile"]["engine"]["num_requests"] == 3
    files = summary["profile"]["self_time_by_file_s"]
    assert any(name.startswith("engine/attention.py") for name in files)
    assert "by tottime" in capsys.readouterr().out


def test_bench_config_rejects_inverted_ranges():
    with pytest.raises(ValueError, match="--min"):
        bench.parse_args(["--min-prompt", "40", "--max-prompt", "20"])
