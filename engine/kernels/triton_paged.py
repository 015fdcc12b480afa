"""Pieces the Triton attention kernels share (decode: triton_decode.py, prefill: triton_prefill.py):
reading a tile of keys and values in place from the paged cache, and folding a tile of scores into an
online softmax (running max, running sum, weighted values, all fp32).

Layout (engine/attention.py): one layer's K/V cache [kv_heads, num_blocks, block_size, head_dim],
contiguous; `kv_base` is the KV head's offset; a row of the block table maps a sequence's positions
to blocks. IEEE: fp32 dots without tf32 (fp32 runs stay HF-equal); otherwise tensor-core dots with fp32
accumulation, the probabilities rounded to the values' dtype first (what the PyTorch path does).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_paged_kv(
    tokens, valid, row_ptr, k_ptr, v_ptr, kv_base, dims, dim_ok, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """K and V rows [tokens, BLOCK_D] of positions `tokens` (0 where not `valid`), and their cache slots."""
    page = tl.load(row_ptr + tokens // BLOCK_SIZE, mask=valid, other=0)
    slot = page * BLOCK_SIZE + tokens % BLOCK_SIZE
    kv_offsets = kv_base + slot[:, None] * HEAD_DIM + dims[None, :]
    kv_mask = valid[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
    return k, v, slot


@triton.jit
def fold_tile(q, k, v, allowed, scale, running_max, running_sum, acc, IEEE: tl.constexpr):
    """Scores of q's rows over k's rows, masked to `allowed` (broadcast to [rows, tokens]), folded into
    the online softmax. A row that has seen no key yet (a sliding window's rows before it starts) keeps
    a running max of -inf; its exponents are shifted by 0 instead, so they add exact zeros, not NaN."""
    if IEEE:  # noqa: SIM108 - Triton JIT code: a constexpr if compiles only its branch
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(allowed, scores * scale, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    weights = tl.exp(scores - shift[:, None])
    correction = tl.exp(running_max - shift)
    running_sum = running_sum * correction + tl.sum(weights, axis=1)
    if IEEE:
        acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v)
    return new_max, running_sum, acc
