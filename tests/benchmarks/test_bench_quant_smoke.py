"""Smoke tests of the quantization benchmarks on a tiny checkpoint: `splitserve bench-engine --accuracy`
prints every metric for every configuration, and its figures mean what they say."""
from __future__ import annotations

import pytest
import torch

from benchmarks import bench_quant_accuracy as accuracy
from benchmarks import bench_quant_throughput as throughput
from tests.factories import TinySpec

# Wide enough for every configuration's groups: 128 inputs per group (int8-weights-g128, int4 g128).
SPEC = TinySpec(weight_std=0.02, hidden_size=128, head_dim=32)


def test_compare_and_agreement_lengths_are_exact():
    reference = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 1.0]])
    same = accuracy.compare(reference, reference.clone())
    assert same["top1_agreement"] == 1.0 and same["max_abs_logit_error"] == 0.0 and abs(same["kl_mean"]) < 1e-7
    flipped = accuracy.compare(reference, torch.tensor([[0.0, 2.0, 1.0], [0.0, 3.5, 1.0]]))
    assert flipped["top1_agreement"] == 0.5 and flipped["max_abs_logit_error"] == 2.0 and flipped["kl_max"] > 0.5
    assert accuracy.agreement_lengths([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]]) == [2, 3]


def test_accuracy_report_through_the_cli(checkpoint, capfd):
    """`splitserve bench-engine --accuracy` runs the benchmark script as its own program (the product imports
    no benchmark code): its report reaches this process's stdout, and its exit status is the command's."""
    from splitserve.cli import main

    model_dir = checkpoint(SPEC)
    with pytest.raises(SystemExit) as done:
        main(["bench-engine", "--accuracy", "--model", str(model_dir), "--prompts", "3", "--min-prompt", "4",
              "--max-prompt", "20", "--max-tokens", "6", "--threads", "1"])
    assert done.value.code == 0
    out = capfd.readouterr().out
    for name in accuracy.CONFIGS:
        assert name in out
    for column in ("mean|dlogit|", "max|dlogit|", "top-1", "KL mean", "greedy agree"):
        assert column in out


def test_throughput_bench_runs_every_configuration(checkpoint, capsys):
    model_dir = checkpoint(SPEC)
    results = throughput.main(["--model", str(model_dir), "--batch-sizes", "2", "--min-prompt", "4",
                               "--max-prompt", "12", "--output", "4", "--rounds", "1", "--threads", "1"])
    assert set(results[2]) == set(throughput.CONFIGS)
    assert all(row["output_tok_s"] > 0 and row["decode_tok_s"] > 0 for row in results[2].values())
    assert "x fp32" in capsys.readouterr().out
