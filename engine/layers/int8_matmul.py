"""`x @ (int8 weight * per-channel scale)ᵀ`: the fastest kernel each case has, behind one function.

Backends, first match wins (measured in benchmarks/bench_int8_matmul.py and bench_gpu_int8_linear.py, README):
- `native`: fp32 activations on CPU with at most NATIVE_MAX_ROWS rows (decode steps): the C kernel
  engine/kernels/int8_linear.c widens int8 weights to fp32 in registers, reading a quarter of the fp32
  bytes. torch's own CPU op for this, `aten._weight_int8pack_mm`, is many times slower than fp32
  `F.linear` with fp32 activations (it is vectorized for bf16 only), and `torch._int_mm` needs int8
  activations (W8A8, not weight-only).
- `int8pack`: bf16 / fp16 activations on CPU: `aten._weight_int8pack_mm`, vectorized there.
- `triton`: bf16 / fp16 activations on CUDA with at most TRITON_MAX_ROWS rows:
  engine/kernels/triton_int8_linear.py widens the int8 weights in registers (a decode step reads
  half of bf16's weight bytes). Imported on first CUDA use: CPU processes never need triton.
- `dequantize`: everything else (large prefill batches, where the matmul's compute hides the
  widening of one layer's weights).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.kernels import kernel

# Above this, widening the weights once and using the BLAS matmul: the crossover is the machine's.
# Measured (README): one AVX-512 Xeon had the C kernel ahead up to 64 rows (1.14x of fp32 at 64,
# widening 0.94x); another has it behind from 16 (0.53x at 32, 0.46x at 64; widening 0.77x, 0.85x),
# where this threshold took the engine's int8 decode at batch 32 from 0.69x to 0.87x of fp32. 16 risks
# ~20% on the first kind of machine at 17-64 rows against 45-85% on the second.
NATIVE_MAX_ROWS = 16
_HALF = (torch.bfloat16, torch.float16)
# H200, bf16 (README): at 256 rows the kernel is 1.0-2.7x the widened path per layer shape, at 512
# 0.84-1.76x (the narrow layers lose), at 2,048 0.87-1.0x.
TRITON_MAX_ROWS = 256


class Backend(NamedTuple):
    name: str
    applies: Callable[[torch.Tensor], bool]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _native_applies(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.shape[0] <= NATIVE_MAX_ROWS
        and kernel("int8_linear") is not None
    )


def _native(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    status = kernel("int8_linear")(
        x.data_ptr(),
        weight.data_ptr(),
        scale.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        weight.shape[0],
        weight.shape[1],
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"int8 linear kernel failed with status {status}")
    return out


def _int8pack(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, weight, scale.to(x.dtype))


def _triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from engine.kernels.triton_int8_linear import int8_linear

    return int8_linear(x, weight, scale)


def _dequantize(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)


BACKENDS = (
    Backend("native", _native_applies, _native),
    Backend("int8pack", lambda x: x.device.type == "cpu" and x.dtype in _HALF, _int8pack),
    Backend("triton", lambda x: x.is_cuda and x.dtype in _HALF and x.shape[0] <= TRITON_MAX_ROWS, _triton),
    Backend("dequantize", lambda x: True, _dequantize),
)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] (model dtype), weight int8 [out, in], scale fp32 [out] → [..., out] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    backend = select_backend(rows)
    return backend.run(rows, weight, scale).view(*x.shape[:-1], weight.shape[0])


def select_backend(rows: torch.Tensor) -> Backend:
    return next(backend for backend in BACKENDS if backend.applies(rows))
