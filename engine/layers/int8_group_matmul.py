"""`x @ dequantized(group-wise int8 weight)ᵀ`, behind one function.

Weights int8 [out, in], symmetric, with one fp32 scale per group of `group_size` consecutive inputs:
`scale` fp32 [out, in / group_size], weight[o, i] = scale[o, i // group_size] * q[o, i]
(`quantize_groupwise` makes them). A scale per group instead of per output channel bounds each
weight's error by half its group's step rather than its row's, which one outlier input feature
otherwise sets for the whole row (the accuracy report: docs/performance.md).

Backends, first match wins:
- `native`: fp32 activations on CPU with at most NATIVE_MAX_ROWS rows (decode steps): the C kernel
  engine/kernels/int8_group_linear.c widens int8 weights to fp32 in registers.
- `dequantize`: everything else: the layer's weights widened to the activations' dtype for one BLAS
  matmul (prefill chunks, where the matmul's compute hides the widening).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import kernel
from engine.layers.int8_matmul import Backend  # the same (name, applies, run) triple

GROUP_ALIGN = 32  # a group is a whole number of the C kernel's vectors on every target
# Above this many rows, widening the weights once and using BLAS: where the two paths cross in
# benchmarks/bench_int4_matmul.py (the `int8g_*` columns, docs/performance.md).
NATIVE_MAX_ROWS = 32


def quantize_groupwise(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] → (int8 [out, in], fp32 scale [out, in / group_size]), symmetric, round to
    nearest: `|weight - q * scale| <= scale / 2` element-wise, scale = max |weight| of the group / 127."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide {in_features} input features")
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    scale = groups.abs().amax(dim=2).clamp_min(1e-30) / 127.0
    values = (groups / scale[:, :, None]).round_().clamp_(-127, 127).to(torch.int8)
    return values.reshape(out_features, in_features), scale


def dequantize_groupwise(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_features, in_features = values.shape
    groups = values.float().reshape(out_features, scale.shape[1], -1) * scale[:, :, None]
    return groups.reshape(out_features, in_features)


def _native_applies(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.shape[0] <= NATIVE_MAX_ROWS
        and kernel("int8_group_linear") is not None
    )


def _native(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    status = kernel("int8_group_linear")(
        x.data_ptr(),
        weight.data_ptr(),
        scale.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        weight.shape[0],
        weight.shape[1],
        weight.shape[1] // scale.shape[1],
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"group-wise int8 linear kernel failed with status {status}")
    return out


def _dequantize(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_groupwise(weight, scale).to(x.dtype))


BACKENDS = (Backend("native", _native_applies, _native), Backend("dequantize", lambda x: True, _dequantize))


def int8_group_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] (model dtype), weight int8 [out, in], scale fp32 [out, groups] → [..., out] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    backend = next(b for b in BACKENDS if b.applies(rows))
    return backend.run(rows, weight, scale).view(*x.shape[:-1], weight.shape[0])
