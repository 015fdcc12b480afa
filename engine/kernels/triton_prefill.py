"""Paged prefill attention for CUDA in Triton: every prefill chunk of a step in one launch per layer.

A chunk's queries attend to its sequence's earlier KV (a prefix hit, an earlier chunk) and to its own
keys, causally: the query at position p sees positions 0..p. The step's KV is written to the cache
before attention runs, so every key is read in place from the paged cache through the chunk's block
table (no gathered copy). Before this kernel, each chunk took a gather of its context and an SDPA call
per layer: a step of 64 x 16-token chunks after 1,024 cached tokens took 144-155 ms on an H200 (bf16,
a 1B Llama), 9.0 ms with it (benchmarks/bench_gpu_prefill.py).

Work split: a program is (query tile, query head); a tile is up to `rows_per_tile` consecutive rows of
one chunk (`PrefillTiles`, engine/attention.py: built once per step, shared by all layers). It keeps
an online softmax in fp32 over key tiles of `KEY_TILE` tokens, up to its last row's position; keys
after a row's own position are masked. With a sliding window (`window` > 0) the row at position p sees
keys p - window + 1 .. p: the key tiles before the tile's first row's window are skipped.

Precision: as the decode kernel (engine/kernels/triton_decode.py): fp32 takes IEEE fp32 dots (HF-equal
runs), bf16/fp16 take tensor-core dots with fp32 accumulation, the probabilities rounded to the cache
dtype before the value product. Quantized caches keep the PyTorch path (engine/quantized_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_paged import fold_tile, load_paged_kv

KEY_TILE = 64  # keys per inner step


@triton.jit
def _key_tile(
    q, keys, positions, lows, end, row_ptr, k_ptr, v_ptr, kv_base, dims, dim_ok, scale, running_max, running_sum,
    acc, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Keys `keys` folded into the online softmax of the tile's rows (a row sees keys from its `lows`
    entry up to its position)."""
    valid = (keys < end) & (keys >= tl.min(lows, axis=0))
    k, v, _ = load_paged_kv(keys, valid, row_ptr, k_ptr, v_ptr, kv_base, dims, dim_ok, BLOCK_SIZE, HEAD_DIM)
    allowed = valid[None, :] & (keys[None, :] <= positions[:, None]) & (keys[None, :] >= lows[:, None])
    return fold_tile(q, k, v, allowed, scale, running_max, running_sum, acc, IEEE)


# Triton compiles a variant per integer argument that is 1 or a multiple of 16; the table's width
# changes with every step's longest chunk, so it is not specialized (no compile mid-serving).
@triton.jit(do_not_specialize=["table_width"])
def _prefill(
    q_ptr, k_ptr, v_ptr, out_ptr, tiles_ptr, tables_ptr, scale, window, table_width, num_heads, stride_kh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr, BOUNDED: tl.constexpr, KEY_TILES: tl.constexpr,
):  # fmt: skip
    tile, head = tl.program_id(0), tl.program_id(1)
    info = tiles_ptr + tile * 4  # (chunk, first row of the step, rows, position of the first row)
    chunk = tl.load(info).to(tl.int32)
    row0 = tl.load(info + 1).to(tl.int32)
    num_rows = tl.load(info + 2).to(tl.int32)
    pos0 = tl.load(info + 3).to(tl.int32)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    dim_ok = dims < HEAD_DIM
    io_offsets = ((row0 + rows) * num_heads + head)[:, None] * HEAD_DIM + dims[None, :]
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + io_offsets, mask=io_mask, other=0.0)
    positions = pos0 + rows  # rows past num_rows see keys they never store: harmless
    end = pos0 + num_rows  # the tile's last row sees keys [0, end)
    lows = tl.where(window > 0, tl.maximum(positions - window + 1, 0), 0)  # each row's first key in view
    row_ptr = tables_ptr + chunk * table_width
    kv_base = (head // GROUP) * stride_kh
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    # Triton's CPU interpreter (the CPU tests) cannot bound a loop by a loaded value: there it runs the
    # step's widest count of key tiles, the surplus fully masked (weights 0), with the same result.
    if BOUNDED:
        for t in range(tl.min(lows, axis=0) // KEYS, tl.cdiv(end, KEYS)):
            running_max, running_sum, acc = _key_tile(
                q, t * KEYS + tl.arange(0, KEYS), positions, lows, end, row_ptr, k_ptr, v_ptr, kv_base, dims,
                dim_ok, scale, running_max, running_sum, acc, BLOCK_SIZE, HEAD_DIM, IEEE,
            )  # fmt: skip
    else:
        for t in range(KEY_TILES):
            running_max, running_sum, acc = _key_tile(
                q, t * KEYS + tl.arange(0, KEYS), positions, lows, end, row_ptr, k_ptr, v_ptr, kv_base, dims,
                dim_ok, scale, running_max, running_sum, acc, BLOCK_SIZE, HEAD_DIM, IEEE,
            )  # fmt: skip
    out = acc / running_sum[:, None]
    tl.store(out_ptr + io_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tiles: torch.Tensor,
    block_tables: torch.Tensor,
    rows_per_tile: int,
    max_context_len: int,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
) -> None:
    """Writes attention outputs of the tiled rows into `out` [tokens, heads * head_dim] (q's rows).

    q [tokens, heads, head_dim]; K/V cache of one layer [kv_heads, num_blocks, block_size, head_dim];
    `tiles` [num_tiles, 4] int64: (chunk, first row in q, rows <= rows_per_tile, position of
    the first row); `block_tables` [num_chunks, width] int64, each chunk's blocks from position 0;
    `max_context_len`: the largest position + 1 of any row (bounds the interpreter's loop); `window`: a
    sliding window in tokens (None: every row sees its whole context)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    assert out.is_contiguous() and out.shape == (num_tokens, num_heads * head_dim)
    q = q.contiguous()
    block_d = max(16, triton.next_power_of_2(head_dim))
    _prefill[(tiles.shape[0], num_heads)](
        q, k_cache, v_cache, out, tiles, block_tables, scale, window or 0, block_tables.shape[1], num_heads,
        k_cache.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        ROWS=rows_per_tile, KEYS=KEY_TILE, IEEE=q.dtype == torch.float32,
        BOUNDED=q.is_cuda, KEY_TILES=1 if q.is_cuda else triton.cdiv(max_context_len, KEY_TILE),
        num_warps=4,
    )  # fmt: skip
