"""Attention over a quantized paged cache in PyTorch: the reference for the native kernel.

The cache is read a chunk of blocks at a time (`CHUNK_BLOCKS` per sequence): each chunk is gathered in
its stored dtype, dequantized, and folded into an online softmax (running max, running sum, running
weighted values, all fp32), so no step ever holds a dequantized copy of a whole sequence's KV.

Both cases are one shape: queries `[kv_heads, batch, rows, head_dim]`, where a decode sequence's rows
are the query heads sharing a KV head, and a prefill chunk's rows are (token, head) pairs. Each row
sees key positions `<= limit[batch, row]`, and with a sliding window only those `> limit - window`.
A chunk in which a row sees nothing adds exact zeros: while a row's running max is still -inf (no key
seen yet) its exponents are shifted by 0 instead, so no -inf - -inf ever reaches one.
"""

from __future__ import annotations

import torch

from engine.kv_storage import LayerKV

CHUNK_BLOCKS = 16  # blocks per sequence dequantized at once


def quantized_decode_attention(
    q: torch.Tensor,
    cache: LayerKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [batch, heads, head_dim] (one query per sequence) → [batch, heads * head_dim]."""
    batch, num_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = cache.k.shape
    queries = q.view(batch, kv_heads, num_heads // kv_heads, head_dim).permute(1, 0, 2, 3)
    # Blocks before every row's window are never read: positions count from the first kept.
    skipped = 0 if window is None else max(0, int((context_lens - window).min())) // block_size
    limits = (context_lens - 1 - skipped * block_size)[:, None].expand(batch, num_heads // kv_heads)
    tables = block_tables[:, skipped:]
    out = _attend(queries, cache, tables, limits, scale, window)  # [kv_heads, batch, group, head_dim]
    return out.permute(1, 0, 2, 3).reshape(batch, num_heads * head_dim).to(q.dtype)


def quantized_prefill_attention(
    q: torch.Tensor,
    cache: LayerKV,
    context_slots: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One sequence's chunk: q [query_len, heads, head_dim], attending causally to its `context_len`
    cached tokens (its own new ones included) → [query_len, heads * head_dim]."""
    query_len, num_heads, head_dim = q.shape
    kv_heads, _, block_size, _ = cache.k.shape
    group = num_heads // kv_heads
    queries = q.view(query_len, kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(kv_heads, 1, -1, head_dim)
    first = context_len - query_len  # absolute position of the chunk's first token
    # Blocks wholly before the first query's window are never read: positions count from the first kept.
    skipped = 0 if window is None else max(0, first - window + 1) // block_size
    table = context_slots[skipped * block_size :: block_size] // block_size  # the blocks, in order
    limits = torch.arange(first, context_len, device=q.device).repeat_interleave(group)[None, :] - skipped * block_size
    out = _attend(queries, cache, table[None, :], limits, scale, window)  # [kv_heads, 1, query_len * group, dim]
    return (
        out.view(kv_heads, query_len, group, head_dim)
        .permute(1, 0, 2, 3)
        .reshape(query_len, num_heads * head_dim)
        .to(q.dtype)
    )


def _attend(
    queries: torch.Tensor,
    cache: LayerKV,
    tables: torch.Tensor,
    limits: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """queries [kv_heads, batch, rows, dim]; tables [batch, blocks]; limits [batch, rows] → like queries."""
    block_size = cache.k.shape[2]
    queries = queries.float() * scale
    kv_heads, batch, rows, dim = queries.shape
    device = queries.device
    running_max = torch.full((kv_heads, batch, rows, 1), float("-inf"), device=device)
    running_sum = torch.zeros(kv_heads, batch, rows, 1, device=device)
    acc = torch.zeros(kv_heads, batch, rows, dim, device=device)
    for start in range(0, tables.shape[1], CHUNK_BLOCKS):
        blocks = tables[:, start : start + CHUNK_BLOCKS]
        keys, values = _dequantized(cache, blocks)  # [kv_heads, batch, tokens, dim]
        positions = start * block_size + torch.arange(keys.shape[2], device=device)
        hidden = positions[None, None, :] > limits[:, :, None]  # [batch, rows, tokens]
        if window is not None:
            hidden |= positions[None, None, :] <= limits[:, :, None] - window
        scores = torch.matmul(queries, keys.transpose(-1, -2)).masked_fill_(hidden[None], float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)  # -inf: no key seen yet
        weights = torch.exp(scores - shift)
        correction = torch.exp(running_max - shift)
        running_sum = running_sum * correction + weights.sum(dim=-1, keepdim=True)
        acc = acc * correction + torch.matmul(weights, values)
        running_max = new_max
    return acc / running_sum


def _dequantized(cache: LayerKV, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `blocks` [batch, n] as fp32 `[kv_heads, batch, n * block_size, dim]`."""
    kv_heads, _, block_size, dim = cache.k.shape
    batch, count = blocks.shape
    out = []
    for values, scales in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):
        assert scales is not None, "a quantized format stores scales"
        chunk = cache.fmt.dequantize(values[:, blocks], scales[:, blocks])  # [kv_heads, batch, n, block, dim]
        out.append(chunk.view(kv_heads, batch, count * block_size, dim))
    return out[0], out[1]
