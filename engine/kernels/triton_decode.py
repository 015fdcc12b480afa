"""Paged decode attention for CUDA in Triton: one query token per sequence, K/V read in place from the
paged cache through the block tables (no gathered copy: each KV byte is read once per layer).

Layout (the engine's, engine/attention.py): q [batch, heads, head_dim]; K/V cache of one layer
[kv_heads, num_blocks, block_size, head_dim]; quantized formats add fp32 scales
[kv_heads, num_blocks, block_size]; block_tables [batch, width] int64; context_lens [batch] int64.

Split-K ("flash decoding"), two launches:
1. `_partial`: program (sequence, KV head, split) covers `tiles_per_split` tiles of `TILE` tokens
   of that sequence and serves all `group` query heads sharing the KV head (GQA: the KV head's bytes
   are read once, not `group` times). It keeps an online softmax in fp32 and writes its running max,
   sum and weighted values. Splits past a sequence's length do nothing.
2. `_combine`: program (sequence, query head) merges the splits that hold tokens.
The split count only depends on the batch size and the table width, so a CUDA graph captured for a
batch size keeps its launch shapes while the sequences grow. A sliding window (`window` > 0) keeps
positions context_len - window .. context_len - 1: splits wholly before it do nothing and are left out
of the merge.

Precision: fp32 caches take IEEE fp32 dots (no tf32), so fp32 runs stay HF-equal; bf16/fp16 caches
take tensor-core dots with fp32 accumulation, the probabilities rounded to the cache dtype before the
value product (what the PyTorch path does). int8 / fp8 caches are dequantized in registers
(value x scale) and multiplied in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.triton_paged import fold_tile, load_paged_kv

TILE_TOKENS = 64  # tokens per inner step: 4 pages of 16
TARGET_PROGRAMS = 1024  # enough (sequence, KV head, split) programs to fill an H100's 132 SMs


class SplitPlan(NamedTuple):
    num_splits: int
    tiles_per_split: int


def split_plan(batch: int, num_kv_heads: int, table_width: int, block_size: int) -> SplitPlan:
    """How many splits each (sequence, KV head) gets: enough programs to fill the GPU, no split
    shorter than one tile. Depends on shapes only (never on context lengths): graph-safe."""
    tiles = max(1, -(-table_width * block_size // TILE_TOKENS))
    splits = max(1, min(tiles, -(-TARGET_PROGRAMS // max(1, batch * num_kv_heads))))
    # A power of two: it is a compile-time constant of the kernel, so few variants ever compile.
    tiles_per_split = triton.next_power_of_2(-(-tiles // splits))
    return SplitPlan(-(-tiles // tiles_per_split), tiles_per_split)


@triton.jit
def _tile(
    q, tokens, low, context_len, row_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kv_base, scale_base, dims, dim_ok, scale,
    running_max, running_sum, acc,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QUANTIZED: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One tile of `tokens` folded into the online softmax (running max, sum, weighted values); the
    tokens in [low, context_len) count."""
    valid = (tokens < context_len) & (tokens >= low)
    k, v, slot = load_paged_kv(tokens, valid, row_ptr, k_ptr, v_ptr, kv_base, dims, dim_ok, BLOCK_SIZE, HEAD_DIM)
    if QUANTIZED:
        k = k.to(tl.float32) * tl.load(ks_ptr + scale_base + slot, mask=valid, other=0.0)[:, None]
        v = v.to(tl.float32) * tl.load(vs_ptr + scale_base + slot, mask=valid, other=0.0)[:, None]
    return fold_tile(q, k, v, valid[None, :], scale, running_max, running_sum, acc, IEEE)


@triton.jit
def _partial(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    tables_ptr,
    lens_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    scale,
    window,
    table_width,
    num_heads,
    num_splits,
    stride_kh,
    stride_sh,
    TILES_PER_SPLIT: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    IEEE: tl.constexpr,
    BOUNDED: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(lens_ptr + seq).to(tl.int32)
    low = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)  # the first position in view
    first = split * TILES_PER_SPLIT * TILE
    if first < context_len and first + TILES_PER_SPLIT * TILE > low:
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, BLOCK_D)
        row_ok = rows < GROUP
        dim_ok = dims < HEAD_DIM
        head = kv_head * GROUP + rows  # the query heads this KV head serves
        q_offsets = (seq * num_heads + head)[:, None] * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if QUANTIZED:
            q = q.to(tl.float32)
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        # The split's tiles from the window's start up to the context's end; within the edge ones, tokens
        # outside are masked (no memory traffic, weights exp(-inf) = 0). The split count follows the
        # table's width (graph-safe), so with a long max_model_len a split spans thousands of tiles that
        # a short context never reaches: a loop over all of them cost 40 ms per step at batch 64 with
        # 131,072-token tables on an H200. Triton's CPU interpreter (the CPU tests) cannot bound a loop
        # by a loaded value: there every tile of the split runs, masked (BOUNDED false), with the same
        # result.
        row = tables_ptr + seq * table_width
        if BOUNDED:
            start = tl.maximum(low - first, 0) // TILE
            for t in range(start, tl.minimum(tl.cdiv(context_len - first, TILE), TILES_PER_SPLIT)):
                running_max, running_sum, acc = _tile(
                    q, first + t * TILE + tl.arange(0, TILE), low, context_len, row, k_ptr, v_ptr, ks_ptr, vs_ptr,
                    kv_head * stride_kh, kv_head * stride_sh, dims, dim_ok, scale, running_max, running_sum, acc,
                    BLOCK_SIZE, HEAD_DIM, QUANTIZED, IEEE,
                )  # fmt: skip
        else:
            for t in range(TILES_PER_SPLIT):
                running_max, running_sum, acc = _tile(
                    q, first + t * TILE + tl.arange(0, TILE), low, context_len, row, k_ptr, v_ptr, ks_ptr, vs_ptr,
                    kv_head * stride_kh, kv_head * stride_sh, dims, dim_ok, scale, running_max, running_sum, acc,
                    BLOCK_SIZE, HEAD_DIM, QUANTIZED, IEEE,
                )  # fmt: skip
        part = (seq * num_heads + head) * num_splits + split  # [GROUP_PAD]
        tl.store(max_ptr + part, running_max, mask=row_ok)
        tl.store(sum_ptr + part, running_sum, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _combine(
    acc_ptr,
    max_ptr,
    sum_ptr,
    lens_ptr,
    out_ptr,
    window,
    num_heads,
    num_splits,
    split_tokens,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(lens_ptr + seq).to(tl.int32)
    used = tl.cdiv(context_len, split_tokens)  # splits that hold tokens
    low = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    skipped = low // split_tokens  # splits wholly before the window: never written
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    ok = (splits < used) & (splits >= skipped)
    part = (seq * num_heads + head) * num_splits + splits
    maxes = tl.load(max_ptr + part, mask=ok, other=float("-inf"))
    overall = tl.max(maxes, axis=0)
    weights = tl.where(ok, tl.exp(maxes - overall), 0.0)
    total = tl.sum(weights * tl.load(sum_ptr + part, mask=ok, other=0.0), axis=0)
    acc = tl.load(
        acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0
    )
    out = tl.sum(acc * weights[:, None], axis=0) / total
    tl.store(
        out_ptr + (seq * num_heads + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: SplitPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q [batch, heads, head_dim] → [batch, heads * head_dim] in q's dtype. Every context_len >= 1.
    `plan` overrides `split_plan` (its tiles_per_split must be a power of two); `window`: a sliding
    window in tokens (None: the whole context)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    q = q.contiguous()
    plan = plan or split_plan(batch, num_kv_heads, block_tables.shape[1], block_size)
    partial = torch.empty(batch, num_heads, plan.num_splits, head_dim, dtype=torch.float32, device=q.device)
    maxes = torch.empty(batch, num_heads, plan.num_splits, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    quantized = k_scale is not None
    block_d = triton.next_power_of_2(head_dim)
    _partial[(batch, num_kv_heads, plan.num_splits)](
        q,
        k_cache,
        v_cache,
        k_scale if quantized else k_cache,
        v_scale if quantized else v_cache,
        block_tables,
        context_lens,
        partial,
        maxes,
        sums,
        scale,
        window or 0,
        block_tables.shape[1],
        num_heads,
        plan.num_splits,
        k_cache.stride(0),
        k_scale.stride(0) if k_scale is not None else 0,
        TILES_PER_SPLIT=plan.tiles_per_split,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, block_d),
        BLOCK_SIZE=block_size,
        TILE=TILE_TOKENS,
        QUANTIZED=quantized,
        IEEE=quantized or q.dtype == torch.float32,
        BOUNDED=q.is_cuda,  # compiled: loop bounded by the context; interpreted (CPU): every tile, masked
        num_warps=4,
    )
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    _combine[(batch, num_heads)](
        partial,
        maxes,
        sums,
        context_lens,
        out,
        window or 0,
        num_heads,
        plan.num_splits,
        plan.tiles_per_split * TILE_TOKENS,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(plan.num_splits),
        num_warps=1,
    )
    return out.view(batch, num_heads * head_dim)
