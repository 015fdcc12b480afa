"""Attention over the paged KV cache, in PyTorch, behind one function (`paged_attention`).

Cache layout, per layer: K and V each `[num_kv_heads, num_blocks, block_size, head_dim]` (see
engine/kv_storage.py, with scales for quantized formats). A token at position p of a sequence lives in
slot `block_table[p // block_size] * block_size + p % block_size`.

On CUDA, decode reads the cache in place through the Triton kernel (engine/kernels/triton_decode.py,
every format), and so does prefill with an unquantized cache: every chunk of the step in one launch
(engine/kernels/triton_prefill.py, tiled by `PrefillTiles`). Elsewhere prefill runs one
`scaled_dot_product_attention` call per chunk (flash / memory-efficient on CUDA).
Unquantized caches take the exact paths below (HF-equal in fp32). A quantized cache (int8 / fp8) is
read by the native decode kernel, which dequantizes in registers, or by
`engine/quantized_attention.py`, which dequantizes a bounded chunk of blocks at a time; a prefill
chunk with no earlier context attends to its own freshly computed keys and values, as unquantized.

Sliding-window layers (`window`: HF's semantics, the query at position p sees keys (p - window, p])
take the same paths with the window's lower bound added to each mask: the kernels skip the blocks
before it, the PyTorch prefill reads only the slots from it on.

A step's tokens are laid out decode-first: the first `num_decode_tokens` rows are single-token decode
queries (one per sequence), then each prefill chunk's rows. A GPU kernel can replace this module by
keeping `AttentionMetadata` and the function's signature.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.kernels import decode_attention_kernel
from engine.kv_storage import LayerKV
from engine.quantized_attention import quantized_decode_attention, quantized_prefill_attention

# Prefill attention on CUDA never takes cuDNN's backend: it builds a plan per new input shape, and
# with GQA in bf16 PyTorch picked it even for a plain causal chunk (measured on an H200: 44 ms of host
# time in `_cudnn_attention_forward` on each new prompt length, ~6 ms for the whole 12-layer forward
# once planned; benchmarks/bench_prefill_attention.py). Flash and memory-efficient kernels plan nothing.
_PLAN_FREE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class PrefillSegment:
    """One sequence's chunk of new tokens: rows [query_start, query_start + query_len) of the step."""

    query_start: int
    query_len: int
    context_len: int  # tokens the chunk attends to = cached/computed before it + query_len
    context_slots: torch.Tensor | None  # [context_len] cache slots; None when the chunk has no prefix


@dataclass(frozen=True)
class PrefillTiles:
    """A step's prefill chunks cut into tiles of consecutive query rows of one chunk, for the Triton
    prefill kernel: built once per step (one small copy to the GPU), read by every layer."""

    tiles: torch.Tensor  # [num_tiles, 4] int64: (chunk, first row of the step, rows, position of row 0)
    block_tables: torch.Tensor  # [num_chunks, width] int64, each chunk's blocks from position 0, padded
    rows_per_tile: int
    max_context_len: int


def prefill_rows_per_tile(dtype: torch.dtype) -> int:
    """Query rows per kernel program: 64 with 16-bit tensor-core dots; 32 in fp32, whose IEEE dots
    hold more registers per row."""
    return 32 if dtype == torch.float32 else 64


def build_prefill_tiles(
    first_row: int,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    block_tables: tuple[torch.Tensor, ...],
    rows_per_tile: int,
    device: torch.device,
) -> PrefillTiles:
    """Chunk i has query_lens[i] rows, laid out from `first_row` in order, and ends at position
    context_lens[i]; block_tables[i] covers its positions [0, context_lens[i])."""
    tiles: list[tuple[int, int, int, int]] = []
    row = first_row
    for chunk, (query_len, context_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        first_position = context_len - query_len
        tiles.extend(
            (chunk, row + offset, min(rows_per_tile, query_len - offset), first_position + offset)
            for offset in range(0, query_len, rows_per_tile)
        )
        row += query_len
    padded = torch.nn.utils.rnn.pad_sequence(list(block_tables), batch_first=True)
    return PrefillTiles(
        torch.tensor(tiles, dtype=torch.int64).to(device), padded.to(device), rows_per_tile, max(context_lens)
    )


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of every new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor  # [num_decode] int64
    # PyTorch path only (None when the native kernel runs): padded token slots and their mask.
    decode_slots: torch.Tensor | None  # [num_decode, max_context] int64 cache slots (padded)
    decode_padding_mask: torch.Tensor | None  # [num_decode, max_context] bool, True = padding
    prefills: tuple[PrefillSegment, ...]
    prefill_tiles: PrefillTiles | None = None  # set: the Triton kernel runs every prefill chunk

    @property
    def uses_kernel(self) -> bool:
        return self.num_decode_tokens > 0 and self.decode_slots is None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] for the step's new tokens.
    Writes k/v into the cache, then returns attention outputs [tokens, heads * head_dim]. `window`:
    the layer's sliding window in tokens (None: the whole context)."""
    cache.write(k, v, meta.slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    n_dec = meta.num_decode_tokens
    if n_dec:
        if meta.uses_kernel and q.is_cuda:
            out[:n_dec] = _decode_attention_triton(q[:n_dec], cache, meta, scale, window)
        elif meta.uses_kernel:
            out[:n_dec] = _decode_attention_native(q[:n_dec], cache, meta, scale, window)
        elif cache.fmt.quantized:
            out[:n_dec] = quantized_decode_attention(
                q[:n_dec], cache, meta.decode_block_tables, meta.decode_context_lens, scale, window
            )
        else:
            out[:n_dec] = _decode_attention(q[:n_dec], cache.k, cache.v, meta, scale, window)
    if meta.prefill_tiles is not None:
        _prefill_attention_triton(q, cache, meta.prefill_tiles, scale, out, window)
        return out
    for seg in meta.prefills:
        rows = slice(seg.query_start, seg.query_start + seg.query_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], cache, seg, scale, window)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    flat = cache.view(num_kv_heads, num_blocks * block_size, head_dim)
    return flat.index_select(1, slots.reshape(-1))


def _decode_attention_native(
    q, cache: LayerKV, meta: AttentionMetadata, scale: float, window: int | None = None
) -> torch.Tensor:
    """The C kernel (engine/kernels): reads each sequence's blocks in place, no padded copy; quantized
    values are dequantized in registers."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = cache.k.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    k_scale, v_scale = (0 if s is None else s.data_ptr() for s in (cache.k_scale, cache.v_scale))
    status = decode_attention_kernel()(
        q.data_ptr(),
        cache.k.data_ptr(),
        cache.v.data_ptr(),
        k_scale,
        v_scale,
        out.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        cache.fmt.kernel_code,
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        tables.shape[1],
        tables.shape[1] * block_size,
        scale,
        window or 0,  # the kernel's "no window"
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"paged decode attention kernel failed with status {status}")
    return out.view(batch, num_heads * head_dim)


def _decode_attention_triton(
    q, cache: LayerKV, meta: AttentionMetadata, scale: float, window: int | None = None
) -> torch.Tensor:
    """The Triton kernel (engine/kernels/triton_decode.py), imported on first CUDA use only: CPU
    processes never need triton."""
    from engine.kernels.triton_decode import paged_decode_attention

    return paged_decode_attention(
        q,
        cache.k,
        cache.v,
        cache.k_scale,
        cache.v_scale,
        meta.decode_block_tables,
        meta.decode_context_lens,
        scale,
        window=window,
    )


def _prefill_attention_triton(
    q, cache: LayerKV, tiles: PrefillTiles, scale: float, out: torch.Tensor, window: int | None = None
) -> None:
    """The Triton prefill kernel (engine/kernels/triton_prefill.py), imported on first CUDA use only."""
    from engine.kernels.triton_prefill import paged_prefill_attention

    paged_prefill_attention(
        q,
        cache.k,
        cache.v,
        tiles.tiles,
        tiles.block_tables,
        tiles.rows_per_tile,
        tiles.max_context_len,
        scale,
        out,
        window=window,
    )


def _decode_attention(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    slots, padding = meta.decode_slots, meta.decode_padding_mask
    assert slots is not None and padding is not None, "the PyTorch decode path needs the padded slots"
    if window is not None:
        # A row's query sits at context_len - 1: keys before context_len - window slid out. Columns before
        # every row's window are not gathered (a host value: this path runs where no kernel does, on CPU).
        lows = meta.decode_context_lens - window
        first = max(0, int(lows.min()))
        columns = torch.arange(first, slots.shape[1], device=q.device)
        slots, padding = slots[:, first:], padding[:, first:] | (columns[None, :] < lows[:, None])
    max_context = slots.shape[1]
    keys = _gather(k_cache, slots).view(num_kv_heads, batch, max_context, head_dim)
    values = _gather(v_cache, slots).view(num_kv_heads, batch, max_context, head_dim)
    # [kv_heads, batch, group, head_dim]: each KV head serves `group` query heads (GQA/MQA).
    queries = q.view(batch, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    scores.masked_fill_(padding[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values)  # [kv_heads, batch, group, head_dim]
    return out.permute(1, 0, 2, 3).reshape(batch, num_heads * head_dim)


def attend_after_context(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """A chunk's queries [1, heads, query_len, dim] over keys/values [1, kv_heads, context_len, dim] whose
    last query_len positions are the chunk's own: query i sits at context_len - query_len + i and sees
    the keys up to it (causal, aligned to the bottom right), and with a `window` only the last `window`
    of them (its own included). Without a window, on CUDA that is PyTorch's `causal_lower_right` bias,
    which runs the flash kernel in bf16/fp16 with no mask tensor built
    (benchmarks/bench_prefill_attention.py); elsewhere the same boolean mask, built here (the bias module
    imports torch._dynamo: 2.4 s and its memory in every worker that never runs on a GPU)."""
    query_len, context_len = queries.shape[2], keys.shape[2]
    if queries.is_cuda and window is None:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(query_len, context_len)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)
    allowed = _causal_mask(query_len, context_len, window, queries.device)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True)


def _causal_mask(query_len: int, context_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[query_len, context_len] bool, True = visible: the queries are the last query_len positions."""
    keys = torch.arange(context_len, device=device)[None, :]
    rows = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    allowed = keys <= rows
    return allowed if window is None else allowed & (keys > rows - window)


def _first_visible(seg: PrefillSegment, window: int | None) -> int:
    """The chunk's earliest key position any of its queries sees (0 without a window)."""
    return 0 if window is None else max(0, seg.context_len - seg.query_len - window + 1)


def _prefill_attention(
    q, k, v, cache: LayerKV, seg: PrefillSegment, scale: float, window: int | None = None
) -> torch.Tensor:
    query_len, num_heads, head_dim = q.shape
    queries = q.transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, head_dim]
    if seg.context_slots is not None and cache.fmt.quantized:
        return quantized_prefill_attention(q, cache, seg.context_slots, seg.context_len, scale, window)
    with sdpa_kernel(_PLAN_FREE_BACKENDS) if q.is_cuda else nullcontext():
        if seg.context_slots is None:
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            if window is None or query_len <= window:  # no key of the chunk slid out of any query's view
                out = F.scaled_dot_product_attention(
                    queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                out = attend_after_context(queries, keys, values, scale, window)
        else:
            # Keys before every query's window are never read; the rest keep their bottom-right alignment.
            slots = seg.context_slots[_first_visible(seg, window) :]
            keys = _gather(cache.k, slots).unsqueeze(0)
            values = _gather(cache.v, slots).unsqueeze(0)
            out = attend_after_context(queries, keys, values, scale, window)
    return out.squeeze(0).transpose(0, 1).reshape(query_len, num_heads * head_dim)
