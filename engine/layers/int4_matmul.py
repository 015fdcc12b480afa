"""`x @ dequantized(int4 weight)ᵀ` for group-wise int4 weights, behind one function.

Weights are stored as the C kernel reads them (engine/kernels/int4_linear.c): uint8 [out, in / 2],
in blocks of 32 inputs per 16 bytes, byte j holding input j (low nibble) and input j + 16 (high nibble);
`scale` and `zero` fp32 [out, in / group_size]; weight[o, i] = scale[o, g] * (q[o, i] - zero[o, g]) with
g = i // group_size.

Backends, first match wins:
- `native`: fp32 activations on CPU with at most NATIVE_MAX_ROWS rows (decode steps): the C kernel
  widens nibbles to fp32 in registers, reading an eighth of the fp32 weight bytes.
- `triton`: bf16 / fp16 activations on CUDA with at most TRITON_MAX_ROWS rows: the Triton kernel
  engine/kernels/triton_int4_linear.py reads this same layout and widens nibbles in registers (a
  decode step reads a quarter of bf16's weight bytes). Imported on first CUDA use: CPU processes never
  need triton. fp32 models take `dequantize` there, as with int8 (fp32 dots miss the tensor cores).
- `dequantize`: everything else: the layer's weights widened to the activations' dtype for one BLAS
  matmul (prefill chunks, where the matmul's compute hides the widening).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.kernels import kernel

BLOCK = 32  # inputs per 16-byte block of the stored layout
# Above this many rows, widening the weights once and using BLAS. benchmarks/bench_int4_matmul.py
# measures the crossover (docs/performance.md): widening a layer costs several passes over its fp32
# copy, so the kernel stays ahead of it well past the int8 kernel's threshold.
NATIVE_MAX_ROWS = 32
_HALF = (torch.bfloat16, torch.float16)
# The int8 kernel's crossover on an H200 (engine/layers/int8_matmul.py); the int4 kernel reads half its
# weight bytes, so it is not measured lower. benchmarks/bench_gpu_int8_linear.py measures both.
TRITON_MAX_ROWS = 256


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """values int [out, in] in [0, 16), in a multiple of 32 → uint8 [out, in / 2] in the kernel's layout."""
    out_features, in_features = values.shape
    if in_features % BLOCK:
        raise ValueError(f"int4 weights need a multiple of {BLOCK} input features, got {in_features}")
    blocks = values.to(torch.uint8).reshape(out_features, -1, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out_features, in_features // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 [out, in / 2] → uint8 [out, in]."""
    blocks = packed.reshape(packed.shape[0], -1, BLOCK // 2)
    return torch.stack([blocks & 0xF, blocks >> 4], dim=2).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    values = unpack_int4(packed).float()
    group_size = values.shape[1] // scale.shape[1]
    return ((values.view(values.shape[0], -1, group_size) - zero[:, :, None]) * scale[:, :, None]).view_as(values)


class Backend(NamedTuple):
    name: str
    applies: Callable[[torch.Tensor], bool]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _native_applies(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.shape[0] <= NATIVE_MAX_ROWS
        and kernel("int4_linear") is not None
    )


def _native(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    in_features = packed.shape[1] * 2
    out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32)
    status = kernel("int4_linear")(
        x.data_ptr(),
        packed.data_ptr(),
        scale.data_ptr(),
        zero.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        packed.shape[0],
        in_features,
        in_features // scale.shape[1],
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"int4 linear kernel failed with status {status}")
    return out


def _triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    from engine.kernels.triton_int4_linear import int4_linear

    return int4_linear(x, packed, scale, zero)


def _dequantize(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_int4(packed, scale, zero).to(x.dtype))


BACKENDS = (
    Backend("native", _native_applies, _native),
    Backend("triton", lambda x: x.is_cuda and x.dtype in _HALF and x.shape[0] <= TRITON_MAX_ROWS, _triton),
    Backend("dequantize", lambda x: True, _dequantize),
)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x [..., in] (model dtype) → [..., out] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    return select_backend(rows).run(rows, packed, scale, zero).view(*x.shape[:-1], packed.shape[0])


def select_backend(rows: torch.Tensor) -> Backend:
    return next(backend for backend in BACKENDS if backend.applies(rows))
