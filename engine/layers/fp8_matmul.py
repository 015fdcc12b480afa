"""`x @ (fp8 e4m3 weight * scale)ᵀ` for FP8 checkpoint layers kept in their stored form, behind one
function.

A layer keeps `weight` float8_e4m3fn [out, in] and `scale` fp32 [out, ceil(in / block_in)]: one factor
per output channel and block of `block_in` inputs (the last block may be partial), so
weight[o, i] = e4m3(weight[o, i]) * scale[o, i // block_in]. Block scales of a checkpoint are stored
once per output row (engine/layers/quantization.py `Fp8Weights`): fused and sharded layers then slice
their rows like the weight's, at 4 / block_in bytes per weight.

Backends, first match wins:
- `triton`: bf16 / fp16 activations on CUDA with at most TRITON_MAX_ROWS rows: the Triton kernel
  engine/kernels/triton_fp8_linear.py decodes and scales the e4m3 bytes in registers (a decode step
  reads half of bf16's weight bytes). Imported on first CUDA use: CPU processes never need triton.
- `dequantize`: everything else (prefill chunks, large batches, fp32 models): the layer widened to the
  activations' dtype for one matmul.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

_HALF = (torch.bfloat16, torch.float16)
# The int8 kernel's crossover on an H200 (engine/layers/int8_matmul.py), which reads the same bytes per
# weight; benchmarks/bench_gpu_int8_linear.py measures the fp8 kernel beside it.
TRITON_MAX_ROWS = 256


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block_in: int) -> torch.Tensor:
    """The layer's fp32 weight [out, in]."""
    return weight.float() * scale.repeat_interleave(block_in, dim=1)[:, : weight.shape[1]]


class Backend(NamedTuple):
    name: str
    applies: Callable[[torch.Tensor], bool]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_in: int) -> torch.Tensor:
    from engine.kernels.triton_fp8_linear import fp8_linear

    return fp8_linear(x, weight, scale, (1, block_in))


def _dequantize(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_in: int) -> torch.Tensor:
    return F.linear(x, dequantize_fp8(weight, scale, block_in).to(x.dtype))


BACKENDS = (
    Backend("triton", lambda x: x.is_cuda and x.dtype in _HALF and x.shape[0] <= TRITON_MAX_ROWS, _triton),
    Backend("dequantize", lambda x: True, _dequantize),
)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_in: int) -> torch.Tensor:
    """x [..., in] (model dtype) → [..., out] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    return select_backend(rows).run(rows, weight, scale, block_in).view(*x.shape[:-1], weight.shape[0])


def select_backend(rows: torch.Tensor) -> Backend:
    return next(backend for backend in BACKENDS if backend.applies(rows))
