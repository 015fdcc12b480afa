"""Pre-quantized checkpoints served by the engine: greedy fp32 tokens equal HF `generate` on the
checkpoint's dequantized weights.

Each case writes a tiny random checkpoint in a published format (GPTQ v1 / v2, act-order, AWQ GEMM, FP8
block-scaled and per-tensor) with the format's round-to-nearest writer, then builds HF's reference by
dequantizing the stored tensors with the straightforward element-by-element reading of each layout
below (independent of the engine's vectorized unpacking) into the fp32 model saved by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from engine.errors import UnsupportedModelError
from engine.model_loader import load_model_config
from engine.quantization import checkpoint_format
from engine.quantization.writer import is_quantized_projection, write_quantized, write_rtn
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

SPEC = TinySpec(arch="llama", hidden_size=64, intermediate_size=128, num_layers=2, seed=31)
CONFIGS = {
    "gptq-v1-w4-g32-sym": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
    "gptq-v2-w8-gall-asym": {
        "quant_method": "gptq",
        "bits": 8,
        "group_size": -1,
        "sym": False,
        "desc_act": False,
        "checkpoint_format": "gptq_v2",
    },
    "gptq-v1-w4-g32-asym-act": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True},
    "awq-w4-g64": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
    "fp8-per-tensor": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _field(words: np.ndarray, slots: np.ndarray, bits: int) -> np.ndarray:
    """Bits [slot * bits, (slot + 1) * bits) of each uint32 word."""
    return ((words.astype(np.int64) >> (bits * slots)) & ((1 << bits) - 1)).astype(np.float32)


def _reference_gptq(parts: dict, config: dict) -> torch.Tensor:
    bits, offset = config["bits"], 0 if config.get("checkpoint_format") == "gptq_v2" else 1
    per_word = 32 // bits
    qweight, qzeros = parts["qweight"].numpy().view(np.uint32), parts["qzeros"].numpy().view(np.uint32)
    scales, g_idx = parts["scales"].float().numpy(), parts["g_idx"].tolist()
    in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
    outputs = np.arange(out_features)
    weight = np.empty((out_features, in_features), dtype=np.float32)
    for i in range(in_features):  # input i: slot i % per_word of row i // per_word, every output at once
        g = g_idx[i]
        q = _field(qweight[i // per_word], np.full(out_features, i % per_word), bits)
        zero = _field(qzeros[g, outputs // per_word], outputs % per_word, bits) + offset
        weight[:, i] = scales[g] * (q - zero)
    return torch.from_numpy(weight)


def _reference_awq(parts: dict, config: dict) -> torch.Tensor:
    qweight, qzeros = parts["qweight"].numpy().view(np.uint32), parts["qzeros"].numpy().view(np.uint32)
    scales = parts["scales"].float().numpy()
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    outputs = np.arange(out_features)
    slots = np.array([AWQ_ORDER.index(o % 8) for o in outputs])  # output o sits in the slot naming it
    weight = np.empty((out_features, in_features), dtype=np.float32)
    for i in range(in_features):
        g = i // config["group_size"]
        q = _field(qweight[i, outputs // 8], slots, 4)
        weight[:, i] = scales[g] * (q - _field(qzeros[g, outputs // 8], slots, 4))
    return torch.from_numpy(weight)


def _reference_fp8(parts: dict, config: dict) -> torch.Tensor:
    values = parts["weight"].float()
    if "weight_block_size" not in config:
        return values * parts["weight_scale"].float()
    rows, cols = config["weight_block_size"]
    scale = parts["weight_scale_inv"]
    weight = torch.empty_like(values)
    for o in range(values.shape[0]):
        weight[o] = values[o] * scale[o // rows, torch.arange(values.shape[1]) // cols]
    return weight


REFERENCES = {"gptq": _reference_gptq, "awq": _reference_awq, "fp8": _reference_fp8}


def _quantize(model_dir: Path, out_dir: Path, config: dict) -> Path:
    fmt = checkpoint_format({"quantization_config": config})
    if not config.get("desc_act"):
        return write_rtn(model_dir, out_dir, fmt)
    generator = torch.Generator().manual_seed(5)  # an act-order permutation per layer, as GPTQ's would be
    return write_quantized(
        model_dir,
        out_dir,
        fmt,
        lambda prefix, weight: fmt.rtn_parts(weight, torch.randperm(weight.shape[1], generator=generator)),
    )


def dequantized_reference(model_dir: Path, quantized_dir: Path, config: dict, out_dir: Path) -> Path:
    with safe_open(quantized_dir / "model.safetensors", framework="pt") as handle:
        stored = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    layers = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_quantized_projection(name):
                prefix = name.removesuffix(".weight")
                parts = {k.removeprefix(prefix + "."): v for k, v in stored.items() if k.startswith(prefix + ".")}
                param.copy_(REFERENCES[config["quant_method"]](parts, config))
                layers += 1
            elif name in stored:  # AWQ rescales the norms that feed its projections
                param.copy_(stored[name])
    assert layers == 7 * SPEC.num_layers
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_engine_on_a_quantized_checkpoint_equals_hf_on_its_dequantized_weights(case, checkpoint, make_llm, tmp_path):
    config = CONFIGS[case]
    model_dir = checkpoint(SPEC)
    quantized = _quantize(model_dir, tmp_path / "quantized", config)
    reference = dequantized_reference(model_dir, quantized, config, tmp_path / "reference")
    prompts = random_prompts(3, 2, 24, SPEC.vocab_size, seed=32)
    expected = hf_greedy_generate(reference, prompts, 10)
    llm = make_llm(str(quantized), dtype="float32", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    # The quantization is part of the model identity (block hashes never mix formats).
    assert load_model_config(quantized).identity.endswith(checkpoint_format({"quantization_config": config}).label)


def test_a_checkpoint_whose_tensors_disagree_with_its_config_fails_naming_the_tensor(checkpoint, make_llm, tmp_path):
    quantized = _quantize(checkpoint(SPEC), tmp_path / "quantized", CONFIGS["gptq-v1-w4-g32-sym"])
    config_path = quantized / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["group_size"] = 64  # the tensors hold groups of 32
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match=r"tensor model\.layers\.\d\.\w+\.\w+_proj\.(scales|qzeros) has shape"
    ):
        make_llm(str(quantized), dtype="float32")
    config["quantization_config"]["quant_method"] = "hqq"
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError, match=r"quant_method='hqq' is not supported; supported: \['awq', 'fp8', 'gptq'\]"
    ):
        make_llm(str(quantized), dtype="float32")


def test_engine_on_a_block_scaled_fp8_checkpoint_equals_transformers_reading_it_itself(checkpoint, make_llm, tmp_path):
    """transformers reads FP8 block-scaled checkpoints itself (fine-grained FP8; on a CPU it dequantizes at
    load): its greedy tokens on the fp8 checkpoint equal the engine's."""
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    quantized = _quantize(checkpoint(SPEC), tmp_path / "quantized", config)
    prompts = random_prompts(3, 2, 24, SPEC.vocab_size, seed=33)
    expected = hf_greedy_generate(quantized, prompts, 10)
    llm = make_llm(str(quantized), dtype="float32", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected
