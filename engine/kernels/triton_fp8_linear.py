"""FP8 weight linear layer for CUDA in Triton: `out = x @ (weight_e4m3 * scale)ᵀ` with the e4m3 weight
decoded and scaled in registers, so a decode step reads 1 byte per weight (half of bf16's) and never
writes a widened copy.

Layout: x [rows, in] (fp32 / bf16 / fp16, contiguous), weight float8_e4m3fn (or its uint8 view)
[out, in], scale fp32 [ceil(out / block_out), ceil(in / block_in)]: weight[o, i] is
`e4m3(weight[o, i]) * scale[o // block_out, i // block_in]`, the last block of a dimension may be
partial (engine/quantization/fp8.py). Per-tensor scales are one block of [out, in], per-channel ones
blocks of [1, in]. out [rows, out] in x's dtype.

The weight is read as bytes and decoded arithmetically (`decode_e4m3`): Triton's CPU interpreter has no
float8 type, and one code path serves both the interpreted tests and the GPU. Each weight is decoded
and scaled in fp32 and rounded once to x's dtype, the same value the `dequantize` path widens the layer
to, so the kernel differs from it only in the order of the fp32 sums.

Program (row tile, column tile, split) and launch plans as engine/kernels/triton_int8_linear.py's
heuristic (shapes only, so a CUDA graph captured for a batch size replays it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_int8_linear import LaunchPlan, heuristic_plan, launch_target, store_tile


@triton.jit
def decode_e4m3(bits):
    """uint8 e4m3fn bit patterns → their fp32 values, exactly: bias 7, subnormals at exponent 0. The
    NaN patterns (0x7F, 0xFF) decode as ±480; e4m3fn weights never hold them."""
    b = bits.to(tl.int32)
    exponent = (b >> 3) & 0xF
    mantissa = b & 0x7
    # A normal value's fp32 bits: the exponent rebiased from 7 to 127, the mantissa's 3 bits on top.
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    # The sign as a bit, not a negation: Triton negates as `0 - x`, which would lose -0.
    return (magnitude.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _decode_e4m3_kernel(bits_ptr, out_ptr, count, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < count
    tl.store(out_ptr + i, decode_e4m3(tl.load(bits_ptr + i, mask=ok, other=0)), mask=ok)


def e4m3_to_float(bits: torch.Tensor) -> torch.Tensor:
    """uint8 bit patterns → fp32 through `decode_e4m3` (what the tests compare with torch's conversion)."""
    bits = bits.contiguous().view(-1)
    out = torch.empty(bits.numel(), device=bits.device, dtype=torch.float32)
    _decode_e4m3_kernel[(triton.cdiv(bits.numel(), 256),)](bits, out, bits.numel(), BLOCK=256)
    return out


@triton.jit
def _fp8_linear(
    x_ptr, w_ptr, scale_ptr, out_ptr, rows, out_features, in_features, scale_cols, block_out, block_in,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One (row tile, column tile, split): fp32 sums over the split's input features, written to the
    workspace `out_ptr` [splits, rows, out] (SPLIT) or rounded to out's dtype."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = m < rows, n < out_features
    scale_rows = (n // block_out) * scale_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * TILES_PER_SPLIT * BLOCK_K
    for tile in range(TILES_PER_SPLIT):
        k = first + tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        w_mask = k_ok[:, None] & n_ok[None, :]
        x = tl.load(x_ptr + m[:, None] * in_features + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        bits = tl.load(w_ptr + n[None, :] * in_features + k[:, None], mask=w_mask, other=0)
        # Scales repeat across a block: these loads hit the cache after the block's first.
        scale = tl.load(scale_ptr + scale_rows[None, :] + (k // block_in)[:, None], mask=w_mask, other=0.0)
        w = (decode_e4m3(bits) * scale).to(x.dtype)
        if IEEE:  # noqa: SIM108 - Triton JIT code: a constexpr if compiles only its branch
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    store_tile(out_ptr, acc, split, rows, out_features, m, n, m_ok, n_ok, SPLIT)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """x [rows, in] → [rows, out] in x's dtype; `block_size` is (block_out, block_in) of `scale`'s grid;
    `plan` overrides the heuristic (benchmarks, tests)."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    block_out, block_in = block_size
    grid_shape = (triton.cdiv(out_features, block_out), triton.cdiv(in_features, block_in))
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8) or weight.shape[1] != in_features:
        raise ValueError(f"fp8 weight must be e4m3 [out, {in_features}], got {weight.dtype} {tuple(weight.shape)}")
    if tuple(scale.shape) != grid_shape:
        raise ValueError(f"fp8 scale must be {grid_shape} for blocks {block_size}, got {tuple(scale.shape)}")
    if rows == 0:
        return x.new_empty(0, out_features)
    x, bits, scale = x.contiguous(), weight.contiguous().view(torch.uint8), scale.float().contiguous()
    plan = plan or heuristic_plan(rows, out_features, in_features)
    grid, split, target = launch_target(plan, rows, out_features, x)
    _fp8_linear[grid](
        x, bits, scale, target, rows, out_features, in_features, grid_shape[1], block_out, block_in,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, TILES_PER_SPLIT=plan.tiles_per_split,
        SPLIT=split, IEEE=x.dtype == torch.float32, num_warps=plan.num_warps,
    )  # fmt: skip
    return target.sum(dim=0).to(x.dtype) if split else target
