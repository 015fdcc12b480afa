"""Weight quantization of linear layers: how a layer stores its weight and multiplies by it.

A linear layer (engine/layers/linear.py) owns its sharding and asks its `LinearMethod` to create its
weight parameters and to apply them; the method never knows about tensor parallelism, the layer never
knows about number formats. A tiny registry (`QUANTIZATIONS`) names the methods:

- `none`: the checkpoint's weights in the model dtype, `F.linear` (a skinny C kernel for a few fp32
  rows on CPU: engine/layers/dense_matmul.py).
- `int8`: weight-only, symmetric, quantized at load from the HF checkpoint: one fp32 scale per output
  channel, or with `quantization_group_size` G one per group of G consecutive input features
  (engine/layers/int8_group_matmul.py). Scales are taken over the full checkpoint row before the layer
  keeps its shard, so a row-parallel rank's slice is exactly the single-rank int8 weights' slice and
  tensor parallelism changes only the summation order (a shard must hold whole groups). Activations
  stay in the model dtype.
- `int4`: weight-only, group-wise, asymmetric: 4-bit values with an fp32 scale and zero point per group
  of consecutive input features (engine/layers/int4_matmul.py). A GPTQ or AWQ checkpoint's layers
  keep their own integers, scales, zero points and group size exactly (engine/quantization/); any other
  checkpoint is rounded to nearest at load, in groups of `quantization_group_size` (default
  INT4_GROUP_SIZE, or the largest of 64 and 32 that divides the layer's inputs). Under tensor
  parallelism a row-parallel shard must hold whole groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UnsupportedModelError
from engine.layers.dense_matmul import dense_linear
from engine.layers.int4_matmul import BLOCK, int4_matmul, pack_int4
from engine.layers.int8_group_matmul import int8_group_matmul, quantize_groupwise
from engine.layers.int8_matmul import int8_matmul
from engine.quantization.base import GroupQuantized
from engine.quantization.rtn import rtn_quantize

INT4_GROUP_SIZE = 128  # inputs per group when rounding an unquantized checkpoint at load


@dataclass(frozen=True)
class WeightQuantization:
    """How the linear layers store their weights: a method of `QUANTIZATIONS` and, for weights
    quantized at load, the input features per scale group (None: the method's default grouping)."""

    method: str = "none"
    group_size: int | None = None


QuantizationSpec = WeightQuantization | str  # a bare method name: its default grouping


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


class Int8GroupWise(LinearMethod):
    """`weight` int8 [out, in] and `weight_scale` fp32 [out, in / group_size]: one scale per group of
    consecutive input features, quantized at load from the fp32 checkpoint tensor like Int8WeightOnly."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer, output_size, input_size, dtype):
        if input_size % self.group_size:
            raise UnsupportedModelError(
                f"quantization_group_size: {self.group_size} does not divide a layer's {input_size} input features "
                "(per tensor-parallel rank); choose a divisor of them"
            )
        layer.weight = _param(output_size, input_size, dtype=torch.int8)
        layer.weight_scale = _param(output_size, input_size // self.group_size, dtype=torch.float32)
        layer.weight.load_dtype = torch.float32
        layer.weight.weight_loader = lambda param, loaded, shard_id=None: self._load(layer, loaded, shard_id)
        layer.weight_scale.filled_by = "weight"

    def _load(self, layer, loaded: torch.Tensor, shard_id) -> None:
        values, scale = quantize_groupwise(loaded, self.group_size)
        layer.weight_loader(layer.weight, values, shard_id)
        layer.weight_loader(layer.weight_scale, scale, shard_id)  # groups shard like the weight's columns

    def apply(self, layer, x, bias=None):
        y = int8_group_matmul(x, layer.weight, layer.weight_scale)
        return y if bias is None else y + bias


class Int4GroupWise(LinearMethod):
    """`weight` uint8 [out, in / 2] (two values a byte, int4_matmul's layout), `weight_scale` and
    `weight_zero` fp32 [out, groups]. Their group count is the checkpoint's, so the scale tensors take
    their shape at load; the layer's own loader keeps this rank's shard of all three. `group_size` is
    the grouping of weights rounded at load (None: INT4_GROUP_SIZE or the largest of 64 and 32 that
    divides the layer's inputs); a pre-quantized layer keeps its own."""

    def __init__(self, group_size: int | None = None):
        self.group_size = group_size

    def create_weights(self, layer, output_size, input_size, dtype):
        if input_size % BLOCK:
            raise UnsupportedModelError(f"int4 weights need a multiple of {BLOCK} input features, got {input_size}")
        layer.weight = _param(output_size, input_size // 2, dtype=torch.uint8)
        layer.weight_scale = _param(output_size, 0, dtype=torch.float32)
        layer.weight_zero = _param(output_size, 0, dtype=torch.float32)
        layer.weight.load_dtype = torch.float32
        layer.weight.weight_loader = lambda param, loaded, shard_id=None: self._load(
            layer, loaded, shard_id, input_size
        )
        layer.weight_scale.filled_by = layer.weight_zero.filled_by = "weight"

    def _load(self, layer, loaded: torch.Tensor, shard_id, input_size_local: int) -> None:
        form = getattr(loaded, "group_quantized", None) or _round_at_load(loaded, self.group_size)
        if form.bits != 4 or not form.contiguous:
            why = f"{form.bits}-bit" if form.bits != 4 else "act-order groups (g_idx) that are not consecutive inputs"
            raise UnsupportedModelError(
                f"layer {form.name}: int4 weights cannot hold {why}; serve it with quantization none"
            )
        if input_size_local % form.group_size:
            raise UnsupportedModelError(
                f"layer {form.name}: a tensor-parallel shard of {input_size_local} input features would split its "
                f"groups of {form.group_size}"
            )
        groups_local = input_size_local // form.group_size
        for param in (layer.weight_scale, layer.weight_zero):
            if param.shape[1] != groups_local:
                param.data = torch.zeros(param.shape[0], groups_local)
        layer.weight_loader(layer.weight, pack_int4(form.values), shard_id)
        layer.weight_loader(layer.weight_scale, form.scales.t().contiguous(), shard_id)
        layer.weight_loader(layer.weight_zero, form.zeros.t().contiguous(), shard_id)

    def apply(self, layer, x, bias=None):
        y = int4_matmul(x, layer.weight, layer.weight_scale, layer.weight_zero)
        return y if bias is None else y + bias


def _round_at_load(weight: torch.Tensor, configured: int | None) -> GroupQuantized:
    in_features = weight.shape[1]
    if configured is not None and in_features % configured:
        raise UnsupportedModelError(
            f"quantization_group_size: {configured} does not divide a layer's {in_features} input features"
        )
    candidates = (INT4_GROUP_SIZE, 64, 32) if configured is None else (configured,)
    group_size = next((g for g in candidates if in_features % g == 0), None)
    if group_size is None:
        raise UnsupportedModelError(f"int4 weights need a multiple of 32 input features, got {in_features}")
    values, scales, zeros = rtn_quantize(weight, 4, group_size, sym=False)
    return GroupQuantized("(rounded at load)", values, scales, zeros.float(), group_size, 4, True)


def _int8(group_size: int | None) -> LinearMethod:
    return Int8WeightOnly() if group_size is None else Int8GroupWise(group_size)


# method name → the LinearMethod for a group size (None: the method's default grouping)
QUANTIZATIONS: dict[str, Callable[[int | None], LinearMethod]] = {
    "none": lambda group_size: Unquantized(),
    "int8": _int8,
    "int4": Int4GroupWise,
}


def as_weight_quantization(spec: QuantizationSpec) -> WeightQuantization:
    return WeightQuantization(spec) if isinstance(spec, str) else spec


def linear_method(spec: QuantizationSpec) -> LinearMethod:
    spec = as_weight_quantization(spec)
    if spec.method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {spec.method!r}; known: {sorted(QUANTIZATIONS)}")
    return QUANTIZATIONS[spec.method](spec.group_size)
