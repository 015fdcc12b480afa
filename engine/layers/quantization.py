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
  keep their own integers, scales, zero points and group size exactly (engine/quantization/); an
  act-order GPTQ layer's inputs are sorted by group at load and its activations' columns permuted to
  match on every call (`input_order`); any other checkpoint is rounded to nearest at load, in groups
  of `quantization_group_size` (default INT4_GROUP_SIZE, or the largest of 64 and 32 that divides the
  layer's inputs). Under tensor parallelism a row-parallel shard must hold whole groups, except an
  act-order layer's: its rank holds every group its inputs touch, as whole groups or as runs of 32
  inputs with the group's scale (whichever is smaller), padded with reads of a zero feature appended
  to the activations (`input_padded`; GroupQuantized.shard_in_group_order).

The registry `STORED_FORMS` names checkpoint formats whose own weights a device multiplies by directly
when `quantization` is none (`weight_quantization` picks it per device): an FP8 checkpoint on CUDA keeps
its e4m3 weights (`fp8`, engine/layers/fp8_matmul.py); elsewhere those layers are dequantized at load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModelError
from engine.layers.dense_matmul import dense_linear
from engine.layers.fp8_matmul import dequantize_fp8, fp8_matmul
from engine.layers.int4_matmul import BLOCK, int4_matmul, pack_int4
from engine.layers.int8_group_matmul import int8_group_matmul, quantize_groupwise
from engine.layers.int8_matmul import int8_matmul
from engine.quantization.base import Float8Stored, GroupQuantized, ceil_div
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
        # Act-order layers: the inputs' order that makes groups consecutive (GroupQuantized.in_group_order),
        # set by the first part loaded; None where the groups are consecutive already.
        layer.register_buffer("input_order", None, persistent=False)
        layer.input_order_loaded = False
        layer.input_padded = False  # input_order reads a zero feature appended to x (act-order shards)

    def _load(self, layer, loaded: torch.Tensor, shard_id, input_size_local: int) -> None:
        full = int4_form(loaded, self.group_size)
        form, order = full.in_group_order()
        if order is not None and input_size_local != form.values.shape[1]:
            _load_act_order_shard(layer, full, shard_id, input_size_local)
            return
        _take_input_order(layer, form.name, order)
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
        if layer.input_order is not None:
            x = (
                x.index_select(-1, layer.input_order)
                if not layer.input_padded
                else F.pad(x, (0, 1))[..., layer.input_order]
            )
        y = int4_matmul(x, layer.weight, layer.weight_scale, layer.weight_zero)
        return y if bias is None else y + bias


def int4_form(loaded: torch.Tensor, group_size: int | None) -> GroupQuantized:
    """A checkpoint tensor's 4-bit integer form: a GPTQ / AWQ layer's own, or the weight rounded at load."""
    form = getattr(loaded, "group_quantized", None) or _round_at_load(loaded, group_size)
    if form.bits != 4:
        raise UnsupportedModelError(
            f"layer {form.name}: int4 weights cannot hold {form.bits}-bit values; serve it with quantization none"
        )
    return form


def _load_act_order_shard(layer: Any, form: GroupQuantized, shard_id, input_size_local: int) -> None:
    """A row-parallel rank's shard of an act-order layer: the layer's own loader says which input
    columns are this rank's (it slices a row of column indices as it slices the weight), and each group
    they touch is held whole (GroupQuantized.shard_in_group_order)."""
    columns = torch.empty(1, input_size_local, dtype=torch.long)
    layer.weight_loader(columns, torch.arange(form.values.shape[1])[None], shard_id)
    # Whole groups (fewer scales) or runs of BLOCK inputs (less padding: a rank holds about 1 / TP of
    # each group): whichever stores fewer bytes for this shard.
    shard, order = min(
        (form.shard_in_group_order(columns[0], run) for run in sorted({form.group_size, BLOCK}, reverse=True)),
        key=lambda candidate: candidate[0].values.numel() // 2 + 8 * candidate[0].scales.numel(),
    )
    _take_input_order(layer, form.name, order)
    layer.input_padded = True
    layer.weight.data = pack_int4(shard.values)
    layer.weight_scale.data = shard.scales.t().contiguous()
    layer.weight_zero.data = shard.zeros.t().contiguous()


def _take_input_order(layer: Any, name: str, order: torch.Tensor | None) -> None:
    """Keeps a part's input order on its layer: every part of a fused layer (q/k/v, gate/up) reads the
    same inputs, so they must share one order (GPTQ's act-order gives inputs with one Hessian one order)."""
    if layer.input_order_loaded:
        kept = layer.input_order
        if (order is None) != (kept is None) or (order is not None and not torch.equal(order, kept)):
            raise UnsupportedModelError(
                f"layer {name}: its inputs are grouped in another order (g_idx) than the checkpoint layers fused "
                "with it; serve it with quantization none"
            )
        return
    layer.input_order = order
    layer.input_order_loaded = True


class Fp8Weights(LinearMethod):
    """An FP8 checkpoint's layers as stored: `weight` float8_e4m3fn [out, in] and `weight_scale` fp32
    [out, ceil(in / weight_block_in)] (engine/layers/fp8_matmul.py). Block scales are repeated per
    output row, so fused (q/k/v, gate/up) and column-parallel layers slice them like the weight's rows;
    one scale column (per-tensor or per-channel scales) serves every input shard. A layer the checkpoint
    leaves unquantized, a fused layer mixing such parts with e4m3 ones, or a row-parallel shard that
    would split a scale block is held in the model dtype (`F.linear`), so the weight's dtype tells
    which form a layer holds. Weights are allocated in e4m3 from the start: the host never holds the
    model dtype's copy of a kept layer."""

    def create_weights(self, layer, output_size, input_size, dtype):
        layer.weight = _param(output_size, input_size, dtype=torch.float8_e4m3fn)
        layer.weight_scale = _param(output_size, 0, dtype=torch.float32)  # sized by the first part loaded
        layer.weight_block_in = input_size
        layer.weight_dtype = dtype
        layer.weight.load_dtype = torch.float32
        layer.weight.weight_loader = lambda param, loaded, shard_id=None: self._load(
            layer, loaded, shard_id, input_size
        )
        layer.weight_scale.filled_by = "weight"

    @staticmethod
    def _load(layer, loaded: torch.Tensor, shard_id, input_size_local: int) -> None:
        form: Float8Stored | None = getattr(loaded, "float8_form", None)
        block_in = None if form is None else _local_block_in(form, input_size_local)
        scaled = layer.weight_scale.shape[1] > 0  # an earlier part arrived in e4m3
        if form is None or block_in is None or (scaled and block_in != layer.weight_block_in):
            _hold_in_model_dtype(layer)
        if layer.weight.dtype != torch.float8_e4m3fn:
            layer.weight_loader(layer.weight, loaded.to(layer.weight.dtype), shard_id)
            return
        assert form is not None and block_in is not None
        if not scaled:
            layer.weight_scale.data = torch.zeros(layer.weight.shape[0], ceil_div(input_size_local, block_in))
            layer.weight_block_in = block_in
        scale_rows = form.scale.repeat_interleave(form.block_size[0], dim=0)[: form.weight.shape[0]]
        layer.weight_loader(layer.weight, form.weight, shard_id)
        # One scale column is every input shard's; block columns shard like the weight's inputs.
        scale_loader = layer.scale_loader if form.scale.shape[1] == 1 else layer.weight_loader
        scale_loader(layer.weight_scale, scale_rows, shard_id)

    def apply(self, layer, x, bias=None):
        if layer.weight.dtype != torch.float8_e4m3fn:  # a layer held in the model dtype (class docstring)
            return dense_linear(x, layer.weight, bias)
        y = fp8_matmul(x, layer.weight, layer.weight_scale, layer.weight_block_in)
        return y if bias is None else y + bias


def _hold_in_model_dtype(layer: Any) -> None:
    """From now on the layer holds its weight in the model dtype; parts loaded in e4m3 so far widen."""
    if layer.weight.dtype == layer.weight_dtype:
        return
    if layer.weight_scale.shape[1] > 0:
        dense = dequantize_fp8(layer.weight, layer.weight_scale, layer.weight_block_in)
        layer.weight.data = dense.to(layer.weight_dtype)
    else:
        layer.weight.data = torch.empty(layer.weight.shape, dtype=layer.weight_dtype)


def _local_block_in(form: Float8Stored, input_size_local: int) -> int | None:
    """Inputs per scale column of this rank's shard, or None where the shard would split a block."""
    if form.scale.shape[1] == 1:
        return input_size_local
    block_in = form.block_size[1]
    sharded = input_size_local != form.weight.shape[1]
    return None if sharded and input_size_local % block_in else block_in


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
    return GroupQuantized("(rounded at load)", values, scales, zeros.float(), group_size, 4, None)


def _int8(group_size: int | None) -> LinearMethod:
    return Int8WeightOnly() if group_size is None else Int8GroupWise(group_size)


# method name → the LinearMethod for a group size (None: the method's default grouping)
QUANTIZATIONS: dict[str, Callable[[int | None], LinearMethod]] = {
    "none": lambda group_size: Unquantized(),
    "int8": _int8,
    "int4": Int4GroupWise,
}


# Checkpoint formats a device multiplies by in their stored form when `quantization` is none:
# quant_method → (device types, the method). Elsewhere their layers are dequantized at load.
STORED_FORMS: dict[str, tuple[frozenset[str], Callable[[int | None], LinearMethod]]] = {
    "fp8": (frozenset({"cuda"}), lambda group_size: Fp8Weights()),
}


def weight_quantization(
    method: str, group_size: int | None, checkpoint_method: str | None, device_type: str
) -> WeightQuantization:
    """How a checkpoint of `checkpoint_method` (None: unquantized) is stored on a device type under
    the configured `quantization` method."""
    devices, _ = STORED_FORMS.get(checkpoint_method or "", (frozenset(), None))
    if method == "none" and device_type in devices:
        return WeightQuantization(checkpoint_method or "none")
    return WeightQuantization(method, group_size)


def as_weight_quantization(spec: QuantizationSpec) -> WeightQuantization:
    return WeightQuantization(spec) if isinstance(spec, str) else spec


def linear_method(spec: QuantizationSpec) -> LinearMethod:
    spec = as_weight_quantization(spec)
    methods = {**QUANTIZATIONS, **{name: method for name, (_, method) in STORED_FORMS.items()}}
    if spec.method not in methods:
        raise ValueError(f"unknown quantization {spec.method!r}; known: {sorted(methods)}")
    return methods[spec.method](spec.group_size)
