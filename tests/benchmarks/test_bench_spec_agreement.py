"""benchmarks/bench_spec_agreement.py: the damped target scales only the upper layers' residual writes,
and at scale 0 the truncated draft computes exactly what the target does (it accepts every draft)."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from benchmarks import bench_spec_agreement as agreement
from tests.factories import TinySpec


def test_damped_target_scales_only_the_upper_layers_residual_writes(checkpoint, tmp_path):
    model_dir = checkpoint(TinySpec(num_layers=3))
    damped = agreement.damped_target(model_dir, 1, 0.25, tmp_path / "damped")
    before = {k: v for shard in model_dir.glob("*.safetensors") for k, v in load_file(shard).items()}
    after = load_file(damped / "model.safetensors")
    assert set(after) == set(before)
    for name, tensor in after.items():
        upper = ".layers.1." in name or ".layers.2." in name
        scaled = upper and name.endswith(agreement.RESIDUAL_WRITES)
        torch.testing.assert_close(tensor, before[name] * 0.25 if scaled else before[name], rtol=0, atol=0)
    assert (damped / "config.json").read_text() == (model_dir / "config.json").read_text()


def test_scale_zero_makes_the_draft_the_target(checkpoint, capsys):
    model_dir = checkpoint(TinySpec(num_layers=3))
    results = agreement.main(["--model", str(model_dir), "--scales", "1,0", "--batches", "1,3",
                              "--max-tokens", "8", "--text-tokens", "6", "--draft-layers", "1",
                              "--num-kv-blocks", "256", "--repeats", "1"])
    for scale, batches in results["scales"].items():
        for rows in batches.values():
            assert set(rows) == {"plain", "draft", "draft-forced"}
            assert all(row["exact"] for row in rows.values())
            assert rows["draft-forced"]["spec_step_share"] == 1.0
            if scale == 0.0:
                assert rows["draft-forced"]["acceptance"] == 1.0
    assert "accept" in capsys.readouterr().out
