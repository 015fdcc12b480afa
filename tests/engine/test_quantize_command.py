"""`splitserve quantize` end to end, and the two calibrated algorithms against round-to-nearest.

Each method writes a tiny random checkpoint in its published format; the engine serving it generates
the greedy fp32 tokens HF `generate` produces on the checkpoint's dequantized weights (read back by the
element-by-element reference of tests/engine/test_quantized_checkpoints.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from engine import SamplingParams
from engine.quantization.awq_search import fake_quantize, search_scales
from engine.quantization.gptq_solver import HessianAccumulator, solve
from engine.quantization.rtn import rtn_quantize
from splitserve.cli import main as cli_main
from tests.engine.test_quantized_checkpoints import dequantized_reference
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

SPEC = TinySpec(arch="llama", num_heads=4, num_kv_heads=4, hidden_size=64, intermediate_size=128, seed=41)
RUNS = {
    "rtn-w8-gall": ["--method", "rtn", "--bits", "8", "--group-size", "-1", "--asym"],
    "gptq-w4-g32-act": ["--method", "gptq", "--bits", "4", "--group-size", "32", "--act-order"],
    "awq-w4-g64": ["--method", "awq", "--bits", "4", "--group-size", "64"],
}
CALIBRATION = ["--num-samples", "4", "--seq-len", "32"]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_each_method_writes_a_checkpoint_the_engine_serves_like_hf_on_its_dequantized_weights(
    run, checkpoint, make_llm, tmp_path, capsys
):
    model_dir = checkpoint(SPEC)
    out = tmp_path / "quantized"
    cli_main(["quantize", str(model_dir), str(out), *RUNS[run], *CALIBRATION])
    assert capsys.readouterr().out.strip().endswith(str(out))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == run.split("-")[0].replace("rtn", "gptq")
    reference = dequantized_reference(model_dir, out, config, tmp_path / "reference")
    prompts = random_prompts(3, 2, 20, SPEC.vocab_size, seed=42)
    expected = hf_greedy_generate(reference, prompts, 8)
    llm = make_llm(str(out), dtype="float32", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_bad_arguments_fail_naming_the_flag(checkpoint, tmp_path):
    model_dir = str(checkpoint(SPEC))
    with pytest.raises(SystemExit, match="--bits: awq writes 4 bits, got 8"):
        cli_main(["quantize", model_dir, str(tmp_path / "a"), "--method", "awq", "--bits", "8"])
    with pytest.raises(SystemExit, match=r"--method: must be one of \['awq', 'gptq', 'rtn'\], got 'hqq'"):
        cli_main(["quantize", model_dir, str(tmp_path / "b"), "--method", "hqq"])
    with pytest.raises(SystemExit, match="--group-size"):
        cli_main(["quantize", model_dir, str(tmp_path / "c"), "--method", "gptq", "--group-size", "48"])


def _correlated_layer(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and inputs whose channels differ in scale and correlate, as activations of a model do."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 128, generator=gen)
    mixing = torch.randn(128, 128, generator=gen) * 0.3
    inputs = torch.randn(1024, 128, generator=gen) @ mixing * (torch.rand(128, generator=gen) * 3) ** 2
    return weight, inputs


def _output_error(inputs: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    return (inputs @ (weight - approx).t()).pow(2).mean().item()


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_reconstructs_the_layer_output_better_than_round_to_nearest(act_order):
    weight, inputs = _correlated_layer(seed=1)
    hessian = HessianAccumulator(128)
    for chunk in inputs.split(300):
        hessian.add(chunk)
    assert torch.allclose(hessian.hessian, 2 * inputs.double().t() @ inputs.double() / len(inputs))
    result = solve(weight, hessian.hessian, bits=4, group_size=32, sym=True, act_order=act_order)
    g_idx = result.g_idx.long()
    gptq = (result.values - result.zeros[g_idx].t()).float() * result.scales[g_idx].t()
    values, scales, zeros = rtn_quantize(weight, 4, 32, sym=True)
    group = torch.arange(128) // 32
    rtn = (values - zeros[group].t()).float() * scales[group].t()
    assert _output_error(inputs, weight, gptq) < 0.75 * _output_error(inputs, weight, rtn)
    assert sorted(torch.bincount(g_idx).tolist()) == [32] * 4  # four groups of 32, in whatever order


def test_awq_scales_reconstruct_the_layer_output_better_than_round_to_nearest():
    weight, inputs = _correlated_layer(seed=2)
    scales = search_scales(inputs, [weight], bits=4, group_size=64)
    awq = fake_quantize(weight * scales, 4, 64) / scales
    assert _output_error(inputs, weight, awq) < 0.9 * _output_error(inputs, weight, fake_quantize(weight, 4, 64))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_refuse_a_mixture_of_experts_model_in_one_line(method, tmp_path):
    from tests.moe_factories import make_moe_checkpoint, moe_spec

    model_dir = make_moe_checkpoint(tmp_path / "model", moe_spec("mixtral", num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(SystemExit, match=rf"--method: {method} calibrates dense .* layer 0 has no .*use --method rtn"):
        cli_main(["quantize", str(model_dir), str(tmp_path / "out"), "--method", method, *CALIBRATION])
    assert not (tmp_path / "out").exists()
