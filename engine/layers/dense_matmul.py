"""`x @ weightᵀ + bias` for unquantized weights: BLAS, or a skinny C kernel for a few fp32 rows on CPU.

A decode or verify step multiplies a handful of rows by every weight of the model, and reads each
weight once: the step is bound by memory. From 2 rows on BLAS packs the weights per call and runs
small-m GEMM tiles, so 5 rows (a speculative verify chunk) cost ~2-4x one row where reading the weights
once costs ~1.2x; `engine/kernels/fp32_linear.c` reads them once per 4 rows (benchmarks/
bench_int8_matmul.py's `fp32_native`, README). One row takes the kernel too: on an AVX-512 Xeon it was
as fast as BLAS's GEMV, on an AVX2-only EPYC 1.2-2x faster (same run). Other dtypes, devices and more
than 8 rows keep BLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import kernel

SKINNY_MIN_ROWS, SKINNY_MAX_ROWS = 1, 8  # measured crossover: BLAS wins again from ~8-16 rows


def _skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        SKINNY_MIN_ROWS <= x.shape[0] <= SKINNY_MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
        and kernel("fp32_linear") is not None
    )


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in], weight [out, in] (the model dtype), bias [out] or None → [..., out]."""
    rows = x.reshape(-1, x.shape[-1])
    if not _skinny_applies(rows, weight):
        return F.linear(x, weight, bias)  # the fused bias, as HF's nn.Linear adds it
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    num_rows, (num_out, num_in) = rows.shape[0], weight.shape
    status = kernel("fp32_linear")(
        rows.data_ptr(), weight.data_ptr(), None, out.data_ptr(), num_rows, num_out, num_in, torch.get_num_threads()
    )
    if status:
        raise RuntimeError(f"fp32 linear kernel failed with status {status}")
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])
