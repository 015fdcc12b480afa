"""Weight quantization of linear layers: how a layer stores its weight and multiplies by it.

A linear layer (engine/layers/linear.py) owns its sharding and asks its `LinearMethod` to create its
weight parameters and to apply them; the method never knows about tensor parallelism, the layer never
knows about number formats. A tiny registry (`QUANTIZATIONS`) names the methods:

- `none`: the checkpoint's weights in the model dtype, `F.linear` (a skinny C kernel for a few fp32
  rows on CPU: engine/layers/dense_matmul.py).
- `int8`: weight-only, symmetric, one fp32 scale per output channel, quantized at load from the HF
  checkpoint. The scale of a row is taken over the full checkpoint row before the layer keeps its
  shard, so a row-parallel rank's slice is exactly the single-rank int8 weights' slice and tensor
  parallelism changes only the summation order. Activations stay in the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.dense_matmul import dense_linear
from engine.layers.int8_matmul import int8_matmul


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LinearMethod:
    """Creates a layer's weight parameters and computes `x @ weightᵀ + bias`."""

    def create_weights(self, layer: nn.Module, output_size: int, input_size: int, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class Unquantized(LinearMethod):
    def create_weights(self, layer, output_size, input_size, dtype):
        layer.weight = _param(output_size, input_size, dtype=dtype)
        layer.weight.weight_loader = layer.weight_loader

    def apply(self, layer, x, bias=None):
        return dense_linear(x, layer.weight, bias)


class Int8WeightOnly(LinearMethod):
    """`weight` int8 [out, in] and `weight_scale` fp32 [out, 1]; the checkpoint tensor arrives in fp32
    (`load_dtype`), is quantized per row, and the layer's own loader keeps this rank's shard of both."""

    def create_weights(self, layer, output_size, input_size, dtype):
        layer.weight = _param(output_size, input_size, dtype=torch.int8)
        layer.weight_scale = _param(output_size, 1, dtype=torch.float32)
        layer.weight.load_dtype = torch.float32
        layer.weight.weight_loader = lambda param, loaded, shard_id=None: self._load(layer, loaded, shard_id)
        layer.weight_scale.filled_by = "weight"  # not a checkpoint tensor: the weight's loader writes it

    @staticmethod
    def _load(layer, loaded: torch.Tensor, shard_id) -> None:
        values, scale = quantize_per_channel(loaded)
        layer.weight_loader(layer.weight, values, shard_id)
        layer.scale_loader(layer.weight_scale, scale[:, None], shard_id)

    def apply(self, layer, x, bias=None):
        y = int8_matmul(x, layer.weight, layer.weight_scale.view(-1))
        return y if bias is None else y + bias


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] → (int8 [out, in], fp32 scale [out]) with weight ≈ values * scale[:, None];
    `|weight - values * scale| <= scale / 2` element-wise."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    values = (weight / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return values, scale


QUANTIZATIONS: dict[str, type[LinearMethod]] = {"none": Unquantized, "int8": Int8WeightOnly}


def linear_method(name: str) -> LinearMethod:
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; known: {sorted(QUANTIZATIONS)}")
    return QUANTIZATIONS[name]()
