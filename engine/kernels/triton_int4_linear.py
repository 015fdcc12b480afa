"""Group-wise int4 weight linear layer for CUDA in Triton: `out = x @ dequant(weight)ᵀ` with the
nibbles, scales and zero points widened in registers, so a decode step reads half a byte per weight
(a quarter of bf16's) plus the group scales, and never writes a widened copy.

Layout: the CPU kernel's, unchanged (engine/layers/int4_matmul.py), so one loaded weight serves both
devices: packed uint8 [out, in / 2] in blocks of 32 inputs per 16 bytes, byte j of a block holding
input j (low nibble) and input j + 16 (high nibble); scale and zero fp32 [out, in / group_size];
weight[o, i] = scale[o, g] * (q[o, i] - zero[o, g]) with g = i // group_size, group_size a multiple of
32. x [rows, in] (fp32 / bf16 / fp16, contiguous); out [rows, out] in x's dtype.

The layout suits the GPU as it is: a tile of bytes splits into a low-nibble and a high-nibble half,
each a [K / 2, N] operand of its own dot with the matching columns of x, and both nibbles of a byte
share a group (groups are whole blocks of 32), so one scale and zero load serves two weights. No repack
at load. Each weight is widened as `(q - zero) * scale` in fp32 and rounded once to x's dtype, the value
the `dequantize` path computes, so the kernel differs from it only in the order of the fp32 sums.

Program (row tile, column tile, split) and launch plans as engine/kernels/triton_int8_linear.py's
heuristic (shapes only, so a CUDA graph captured for a batch size replays it); a plan's `block_k`
must be a multiple of 32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_int8_linear import LaunchPlan, heuristic_plan, launch_target, store_tile

BLOCK = 32  # inputs per 16-byte block of the stored layout


@triton.jit
def _int4_linear(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, rows, out_features, in_features, group_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One (row tile, column tile, split): fp32 sums over the split's input features, written to the
    workspace `out_ptr` [splits, rows, out] (SPLIT) or rounded to out's dtype."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = m < rows, n < out_features
    row_bytes = in_features // 2
    groups = in_features // group_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_byte = split * TILES_PER_SPLIT * (BLOCK_K // 2)
    for tile in range(TILES_PER_SPLIT):
        p = first_byte + tile * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # byte offsets within a row
        p_ok = p < row_bytes
        k_low = (p // 16) * 32 + p % 16  # the input each byte's low nibble holds; high: + 16
        w_mask = p_ok[:, None] & n_ok[None, :]
        x_mask = m_ok[:, None] & p_ok[None, :]
        bits = tl.load(w_ptr + n[None, :] * row_bytes + p[:, None], mask=w_mask, other=0).to(tl.int32)
        group = n[None, :] * groups + (k_low // group_size)[:, None]
        scale = tl.load(scale_ptr + group, mask=w_mask, other=0.0)
        zero = tl.load(zero_ptr + group, mask=w_mask, other=0.0)
        x_low = tl.load(x_ptr + m[:, None] * in_features + k_low[None, :], mask=x_mask, other=0.0)
        x_high = tl.load(x_ptr + m[:, None] * in_features + (k_low + 16)[None, :], mask=x_mask, other=0.0)
        w_low = (((bits & 0xF).to(tl.float32) - zero) * scale).to(x_low.dtype)
        w_high = (((bits >> 4).to(tl.float32) - zero) * scale).to(x_low.dtype)
        if IEEE:
            acc = tl.dot(x_low, w_low, acc, input_precision="ieee")
            acc = tl.dot(x_high, w_high, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_low, w_low, acc)
            acc = tl.dot(x_high, w_high, acc)
    store_tile(out_ptr, acc, split, rows, out_features, m, n, m_ok, n_ok, SPLIT)


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, plan: LaunchPlan | None = None
) -> torch.Tensor:
    """x [rows, in] → [rows, out] in x's dtype; `plan` overrides the heuristic (benchmarks, tests)."""
    rows, in_features = x.shape
    out_features = packed.shape[0]
    if packed.dtype != torch.uint8 or packed.shape[1] * 2 != in_features or in_features % BLOCK:
        raise ValueError(
            f"int4 weight must be uint8 [out, {in_features} / 2] over a multiple of {BLOCK} inputs, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    groups = scale.shape[1]
    group_size = in_features // max(groups, 1)
    if scale.shape != (out_features, groups) or zero.shape != scale.shape or group_size * groups != in_features:
        raise ValueError(f"int4 scale and zero must be [{out_features}, groups], got {tuple(scale.shape)}")
    if group_size % BLOCK:
        raise ValueError(f"int4 group size must be a multiple of {BLOCK}, got {group_size}")
    if rows == 0:
        return x.new_empty(0, out_features)
    plan = plan or heuristic_plan(rows, out_features, in_features)
    if plan.block_k % BLOCK:
        raise ValueError(f"int4 launch plan needs block_k a multiple of {BLOCK}, got {plan.block_k}")
    x, packed = x.contiguous(), packed.contiguous()
    scale, zero = scale.float().contiguous(), zero.float().contiguous()
    grid, split, target = launch_target(plan, rows, out_features, x)
    _int4_linear[grid](
        x, packed, scale, zero, target, rows, out_features, in_features, group_size,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, TILES_PER_SPLIT=plan.tiles_per_split,
        SPLIT=split, IEEE=x.dtype == torch.float32, num_warps=plan.num_warps,
    )  # fmt: skip
    return target.sum(dim=0).to(x.dtype) if split else target
