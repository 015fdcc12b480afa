"""FP8 checkpoints (`quant_method: fp8`): e4m3 weights with their scales, as DeepSeek-V3, the Qwen3-FP8
releases and vLLM's serialized fp8 write them.

- With `weight_block_size: [bo, bi]` (block-scaled, DeepSeek's layout): `weight` float8_e4m3fn
  [out, in] and `weight_scale_inv` fp32 [ceil(out / bo), ceil(in / bi)], one factor per block (the
  last block of a dimension may be partial); weight[o, i] = weight_fp8[o, i] * scale_inv[o // bo, i // bi].
  Despite its name the factor multiplies.
- Without it: one scale per tensor (one element) or per output channel ([out] or [out, 1]), named
  `weight_scale` (vLLM) or `weight_scale_inv`.

Only weights are read and activations stay in the model dtype, as transformers does when it
dequantizes an FP8 checkpoint: on the CPU the weights are dequantized at load; on CUDA the linear
layers keep them as e4m3 (`float8_form`, engine/layers/quantization.py `Fp8Weights`). `input_scale`
(static activation scales) and `activation_scale` tensors are accepted and not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import UnsupportedModelError
from engine.quantization.base import (
    CheckpointFormat,
    Float8Stored,
    ceil_div,
    config_field,
    expect_dtype,
    expect_shape,
)

SCALE_PARTS = ("weight_scale_inv", "weight_scale")
UNUSED_PARTS = ("input_scale", "activation_scale")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


@dataclass(frozen=True)
class Fp8Format(CheckpointFormat):
    block_size: tuple[int, int] | None  # (output rows, input columns) per scale; None: per tensor / channel

    method = "fp8"
    # A layer left unquantized (the LM head, norms) has an ordinary `weight` and no scale.
    marker_parts = SCALE_PARTS
    layer_parts = ("weight", *SCALE_PARTS, *UNUSED_PARTS)

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Fp8Format:
        if "fmt" in raw:
            config_field(raw, "fmt", ("e4m3",), cls.method)
        if "activation_scheme" in raw:
            config_field(raw, "activation_scheme", ("dynamic", "static"), cls.method)
        block = raw.get("weight_block_size")
        if block is None:
            return cls(block_size=None)
        if not (
            isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise UnsupportedModelError(
                f"quantization_config.weight_block_size must be two positive integers, got {block!r}"
            )
        return cls(block_size=(block[0], block[1]))

    @property
    def label(self) -> str:
        return "fp8-e4m3-" + (f"b{self.block_size[0]}x{self.block_size[1]}" if self.block_size else "tensor")

    def required_parts(self, present: set[str]) -> tuple[str, ...]:
        if self.block_size is not None:
            return ("weight", "weight_scale_inv")
        return ("weight", next((p for p in SCALE_PARTS if p in present), "weight_scale"))

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = parts["weight"]
        expect_dtype(f"{prefix}.weight", weight, (FP8_DTYPE,), "fp8 e4m3 weight")
        if weight.dim() != 2:
            raise UnsupportedModelError(f"tensor {prefix}.weight must be 2-D, has shape {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        scale_part = self.required_parts(set(parts))[1]
        scale = parts[scale_part].float()
        name = f"{prefix}.{scale_part}"
        if self.block_size is not None:
            rows, cols = self.block_size
            grid = (ceil_div(out_features, rows), ceil_div(in_features, cols))
            expect_shape(
                name, scale, grid, f"weight_block_size={list(self.block_size)}, weight {out_features}x{in_features}"
            )
            full = scale.repeat_interleave(rows, dim=0)[:out_features].repeat_interleave(cols, dim=1)[:, :in_features]
        elif scale.numel() == 1:
            full = scale.reshape(1, 1)
        elif scale.numel() == out_features and scale.dim() <= 2 and scale.shape[0] == out_features:
            full = scale.reshape(out_features, 1)
        else:
            raise UnsupportedModelError(
                f"tensor {name} has shape {tuple(scale.shape)}: expected one scale per tensor or per output channel "
                f"({out_features}) since quantization_config has no weight_block_size"
            )
        return weight.float() * full

    def float8_form(self, prefix: str, parts: dict[str, torch.Tensor]) -> Float8Stored:
        weight = parts["weight"]
        out_features, in_features = weight.shape
        scale = parts[self.required_parts(set(parts))[1]].float()
        if self.block_size is not None:
            return Float8Stored(prefix, weight, scale, self.block_size)
        if scale.numel() == 1:
            return Float8Stored(prefix, weight, scale.reshape(1, 1), (out_features, in_features))
        return Float8Stored(prefix, weight, scale.reshape(out_features, 1), (1, in_features))

    def rtn_parts(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scales map each block's (or the tensor's) largest magnitude to e4m3's largest finite value."""
        weight = weight.float()
        out_features, in_features = weight.shape
        if self.block_size is None:
            scale = (weight.abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(1)
            return {"weight": (weight / scale).to(FP8_DTYPE), "weight_scale": scale}
        rows, cols = self.block_size
        scale = torch.empty(ceil_div(out_features, rows), ceil_div(in_features, cols))
        values = torch.empty(out_features, in_features, dtype=FP8_DTYPE)
        for r in range(scale.shape[0]):
            for c in range(scale.shape[1]):
                block = weight[r * rows : (r + 1) * rows, c * cols : (c + 1) * cols]
                scale[r, c] = (block.abs().amax() / FP8_MAX).clamp_min(1e-12)
                values[r * rows : (r + 1) * rows, c * cols : (c + 1) * cols] = (block / scale[r, c]).to(FP8_DTYPE)
        return {"weight": values, "weight_scale_inv": scale}

    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"quant_method": self.method, "fmt": "e4m3", "activation_scheme": "dynamic"}
        if self.block_size is not None:
            config["weight_block_size"] = list(self.block_size)
        return config
