"""Checks of the Triton paged prefill kernel, shared by the CPU (interpreted) and CUDA tests.

`python -m tests.engine.triton_prefill_checks` with `TRITON_INTERPRET=1` runs them on the CPU under
Triton's interpreter, in a fresh process (see tests/engine/triton_decode_checks.py for why).
"""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillSegment, build_prefill_tiles, paged_attention
from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage

# heads, kv_heads, head_dim, block_size, rows per tile, decode rows before the chunks,
# chunks as (new tokens, context length): a chunk with no prefix has them equal.
SHAPES = [
    (4, 2, 16, 4, 16, 0, [(5, 5), (17, 40), (1, 9), (33, 33)]),
    (8, 1, 32, 16, 16, 3, [(20, 100), (16, 16)]),
    (4, 4, 24, 16, 32, 1, [(40, 70), (2, 130)]),
    (6, 2, 64, 32, 16, 0, [(64, 64)]),
]


def _case(shape, dtype, device, seed):
    """q rows for every chunk (after the decode rows), the cache filled at random, and the chunks'
    block tables (random distinct blocks, each table exactly as long as its context needs)."""
    heads, kv_heads, head_dim, block_size, _, decode_rows, chunks = shape
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-ctx // block_size) for _, ctx in chunks) + 4
    k, v = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(decode_rows + sum(n for n, _ in chunks), heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for _, ctx in chunks:
        width = -(-ctx // block_size)
        tables.append(order[used : used + width].clone())
        used += width
    to = dict(device=device)
    return q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), [t.to(**to) for t in tables]


def _reference(q, k, v, tables, shape, scale):
    """Exact causal attention in fp64, chunk by chunk, over keys gathered by position."""
    heads, kv_heads, head_dim, block_size, _, decode_rows, chunks = shape
    out, row = torch.zeros(q.shape[0], heads * head_dim, dtype=torch.float64, device=q.device), decode_rows
    for (new, ctx), table in zip(chunks, tables, strict=True):
        positions = torch.arange(ctx, device=q.device)
        slots = table[positions // block_size] * block_size + positions % block_size
        keys = k.reshape(kv_heads, -1, head_dim)[:, slots].double().repeat_interleave(heads // kv_heads, 0)
        values = v.reshape(kv_heads, -1, head_dim)[:, slots].double().repeat_interleave(heads // kv_heads, 0)
        queries = q[row : row + new].double().transpose(0, 1)  # [heads, new, dim]
        scores = queries @ keys.transpose(-1, -2) * scale
        query_positions = torch.arange(ctx - new, ctx, device=q.device)
        scores.masked_fill_(positions[None, :] > query_positions[:, None], float("-inf"))
        out[row : row + new] = (scores.softmax(-1) @ values).transpose(0, 1).reshape(new, -1)
        row += new
    return out


def _tiles(shape, tables, device):
    _, _, _, _, rows, decode_rows, chunks = shape
    return build_prefill_tiles(
        decode_rows, tuple(n for n, _ in chunks), tuple(c for _, c in chunks), tuple(tables), rows, device
    )


def check_exact(module, device, dtype, tolerance):
    """Every chunk's rows against the fp64 reference; the decode rows before them are left alone."""
    for index, shape in enumerate(SHAPES):
        q, k, v, tables = _case(shape, dtype, device, seed=index)
        scale = shape[2] ** -0.5
        tiles = _tiles(shape, tables, device)
        out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), 7.0, dtype=dtype, device=device)
        module.paged_prefill_attention(
            q, k, v, tiles.tiles, tiles.block_tables, tiles.rows_per_tile, tiles.max_context_len, scale, out
        )
        decode_rows = shape[5]
        assert bool((out[:decode_rows] == 7.0).all()), (shape, "a decode row was written")
        error = (out[decode_rows:].double() - _reference(q, k, v, tables, shape, scale)[decode_rows:]).abs().max()
        assert error.item() <= tolerance, (shape, dtype, error.item())


def check_paged_attention_dispatch(device, dtype, tolerance):
    """`paged_attention` with `prefill_tiles` (the kernel) equals it without (one SDPA call per chunk),
    the new keys written to the cache first in both."""
    heads, kv_heads, head_dim, block_size, rows, _, chunks = SHAPES[0]
    shape = (heads, kv_heads, head_dim, block_size, rows, 0, chunks)
    q, _, _, tables = _case(shape, dtype, device, seed=11)
    cache = KVCacheStorage(kv_format("auto", dtype), 1, kv_heads, 64, block_size, head_dim, torch.device(device))
    gen = torch.Generator().manual_seed(12)
    for layer in (cache.layer(0).k, cache.layer(0).v):
        layer.copy_(torch.randn(layer.shape, generator=gen).to(dtype))
    new_k, new_v = (torch.randn(q.shape[0], kv_heads, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    slots, segments, row = [], [], 0
    for (new, ctx), table in zip(chunks, tables, strict=True):
        positions = torch.arange(ctx, device=device)
        context_slots = table[positions // block_size] * block_size + positions % block_size
        slots.append(context_slots[ctx - new :])
        segments.append(PrefillSegment(row, new, ctx, context_slots if ctx > new else None))
        row += new
    slot_mapping = torch.cat(slots)
    empty = torch.zeros(0, 1, dtype=torch.int64, device=device)
    lens = torch.zeros(0, dtype=torch.int64, device=device)
    plain = AttentionMetadata(slot_mapping, 0, empty, lens, None, None, tuple(segments))
    tiled = AttentionMetadata(slot_mapping, 0, empty, lens, None, None, tuple(segments), _tiles(shape, tables, device))
    scale = head_dim**-0.5
    expected = paged_attention(q, new_k, new_v, cache.layer(0), plain, scale)
    got = paged_attention(q, new_k, new_v, cache.layer(0), tiled, scale)
    error = (got.double() - expected.double()).abs().max().item()
    assert error <= tolerance, (dtype, error)


def check_engine_equals_hf(model_dir, device: str) -> None:
    """The engine with the kernel forced on (on the CPU: interpreted) gives HF's greedy tokens in fp32
    over chunked prompts (16-token chunks, several per step) and prefix hits."""
    from engine import LLM, SamplingParams
    from tests.factories import hf_greedy_generate, random_prompts

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    shared = random_prompts(1, 40, 40, 512, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 30, 512, seed=3)]
    expected = hf_greedy_generate(model_dir, prompts, greedy.max_tokens, device=device)
    llm = LLM(model_dir, progress=False, device=device, prefill_chunk_tokens=16, max_num_batched_tokens=48)
    llm.engine.runner.prefill_rows_per_tile = 16  # the kernel, interpreted where no GPU compiles it
    tokens = lambda batch: [list(o.token_ids) for o in llm.generate(batch, greedy, use_tqdm=False)]  # noqa: E731
    assert tokens(prompts[:1]) == expected[:1]  # caches the shared prefix
    assert tokens(prompts) == expected


if __name__ == "__main__":
    import sys
    import tempfile
    from pathlib import Path

    from engine.kernels import triton_prefill
    from tests.factories import TinySpec, make_tiny_checkpoint

    check_exact(triton_prefill, "cpu", torch.float32, 1e-5)
    check_paged_attention_dispatch("cpu", torch.float32, 1e-5)
    if "--engine" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            check_engine_equals_hf(make_tiny_checkpoint(Path(tmp) / "llama", TinySpec()), "cpu")
    print("interpreted prefill kernel checks passed")
