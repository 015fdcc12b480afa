"""Tiny random mixture-of-experts and latent-attention checkpoints (Mixtral, Qwen2/Qwen3-MoE,
DeepSeek-V2/V3), built with transformers' own config and model classes and saved with
`save_pretrained` (HF writes one tensor per expert and projection, the layout real checkpoints use).

Weights follow tests/factories.py (std 0.25, jittered norms, one seeded generator). DeepSeek-V3's
routing correction bias starts at zero in HF; it is randomized here (uniform [0, 1), the size of the
sigmoid scores it shifts) so the biased choice and the grouped top-k are exercised. Router weights get
a larger std so that routing is decisive: a token whose top-k choice hangs on a rounding tie would
make an exact-token comparison meaningless.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    GenerationConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from engine.demo_model import SPECIAL_TOKEN_IDS
from engine.layers.int8_group_matmul import dequantize_groupwise, quantize_groupwise
from engine.layers.quantization import quantize_per_channel
from tests.factories import _tokenizer

_CONFIGS: dict[str, type[PretrainedConfig]] = {
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "deepseek_v2": DeepseekV2Config,
    "deepseek_v3": DeepseekV3Config,
}
_WEIGHT_STD = 0.25
_ROUTER_STD = 1.0
_NORM_JITTER = 0.2


@dataclass(frozen=True)
class MoESpec:
    """One tiny checkpoint: `family` picks the HF config class, `options` its family-specific knobs
    (expert counts, top-k, shared experts, grouped routing, dense layers, MLA ranks)."""

    family: str
    options: tuple[tuple[str, object], ...] = ()
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    vocab_size: int = 512
    seed: int = 0
    weight_std: float = _WEIGHT_STD  # accuracy tests of quantized caches use HF's softer 0.02

    def __post_init__(self) -> None:
        if self.family not in _CONFIGS:
            raise ValueError(f"unknown family {self.family!r}; known: {sorted(_CONFIGS)}")


def moe_spec(family: str, seed: int = 0, num_layers: int = 2, weight_std: float = _WEIGHT_STD, **options) -> MoESpec:
    return MoESpec(family, tuple(sorted(options.items())), num_layers=num_layers, seed=seed, weight_std=weight_std)


def _hf_config(spec: MoESpec) -> PretrainedConfig:
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=96,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32",
        **SPECIAL_TOKEN_IDS,
    )
    if spec.family in ("deepseek_v2", "deepseek_v3"):
        common.update(num_key_value_heads=spec.num_heads, moe_intermediate_size=32, kv_lora_rank=16,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1)
    else:
        common.update(num_key_value_heads=2, head_dim=16, sliding_window=None)
        if spec.family != "mixtral":
            common.update(moe_intermediate_size=32)
    # Options are tuples (the spec is hashable); HF's configs want lists, rope_parameters a mapping.
    for key, value in spec.options:
        common[key] = dict(value) if key == "rope_parameters" else list(value) if isinstance(value, tuple) else value
    return _CONFIGS[spec.family](**common)


def _randomize_(model: torch.nn.Module, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + _NORM_JITTER * noise.clamp(-2, 2) / 2)
            elif name.endswith("gate.weight"):  # the router (not the shared expert's gate)
                param.copy_(_ROUTER_STD * noise)
            else:
                param.copy_(std * noise)
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand(buffer.shape, generator=gen))


def make_moe_checkpoint(out_dir: Path, spec: MoESpec) -> Path:
    out_dir = Path(out_dir)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(_hf_config(spec), dtype=torch.float32)
    _randomize_(model, spec.seed, spec.weight_std)
    model.generation_config = GenerationConfig(**SPECIAL_TOKEN_IDS)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    _tokenizer(spec.vocab_size, 512).save_pretrained(out_dir, save_jinja_files=False)
    return out_dir


def dequantized_moe_checkpoint(model_dir: Path, out_dir: Path, group_size: int | None = None) -> Path:
    """The checkpoint with every decoder linear weight and every expert projection replaced by its int8
    value x scale (one scale per output channel of each expert, or per group of `group_size` inputs):
    HF on it computes what the int8 engine should. Routers and Qwen2-MoE's shared-expert gate stay in
    full precision, as the engine keeps them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            gate = name.endswith("shared_expert_gate")  # a [1, hidden] gate: the engine keeps it in full
            if isinstance(module, torch.nn.Linear) and name.startswith("model.layers.") and not gate:
                module.weight.copy_(_dequantized(module.weight, group_size))
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                for expert in range(param.shape[0]):
                    param[expert].copy_(_dequantized(param[expert], group_size))
    model.save_pretrained(out_dir)
    return out_dir


def _dequantized(weight: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """weight [out, in] → its int8 values x scales, per output channel or per group of inputs."""
    if group_size is None:
        values, scale = quantize_per_channel(weight)
        return values.float() * scale[:, None]
    return dequantize_groupwise(*quantize_groupwise(weight, group_size))
