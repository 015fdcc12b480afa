"""Sliding-window attention in every attention path, against exact fp64 attention over each row's
window (the query at position p sees keys p - window + 1 .. p, HF's masks): the native C decode kernel
(fp32 / int8 / fp8 caches), the PyTorch decode and prefill paths (a chunk with and without earlier
context, unquantized and quantized caches), and the Triton decode and prefill kernels under Triton's
CPU interpreter (`python -m tests.engine.test_sliding_window_kernels` with `TRITON_INTERPRET=1`).

Windows are chosen smaller than, equal to and larger than the contexts, and not multiples of the block
size, so a window's first key falls inside a block, on a block's edge and before position 0."""
from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, PrefillSegment, build_prefill_tiles, paged_attention
from engine.kernels import decode_attention_kernel
from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage

# heads, kv_heads, head_dim, block_size: MHA, GQA with the C kernel's head_dim-64 path, MQA.
SHAPES = [(4, 4, 16, 4), (8, 2, 64, 16), (4, 1, 32, 8)]
DECODE_LENS = [1, 5, 16, 17, 40, 130]
LONG_DECODE_LENS = [60, 75, 130]  # every row past the windows below 60: the blocks before them are skipped
WINDOWS = [1, 7, 16, 33, 500]
# (new tokens, context length) per prefill chunk: no prefix, a prefix, a one-token tail, a long chunk.
CHUNKS = [(12, 12), (9, 45), (2, 70), (40, 40)]
QUANT_TOLERANCE = 1e-5  # against fp64 attention over the dequantized values (fp32 rounding only)


def _storage(kv_heads, head_dim, block_size, num_blocks, fmt_name, gen, device="cpu"):
    """A one-layer cache filled at random, and an fp32 one holding exactly the values it dequantizes to."""
    cache = KVCacheStorage(kv_format(fmt_name, torch.float32), 1, kv_heads, num_blocks, block_size, head_dim, device)
    slots = torch.arange(num_blocks * block_size, device=device)
    k, v = (torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(device) for _ in range(2))
    cache.layer(0).write(k, v, slots)
    layer = cache.layer(0)
    if not cache.fmt.quantized:
        return cache, layer.k.double(), layer.v.double()
    keys = cache.fmt.dequantize(layer.k, layer.k_scale).double()
    return cache, keys, cache.fmt.dequantize(layer.v, layer.v_scale).double()


def _tables(lens, block_size, num_blocks, gen):
    """Random distinct blocks per sequence, padded with block 0 to the widest."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in lens)
    tables, used = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(order[used : used + count] + [0] * (width - count))
        used += count
    return torch.tensor(tables, dtype=torch.int64)


def _reference(q, keys, values, table, block_size, positions, window):
    """fp64 attention of q [rows, heads, dim] at `positions` over one sequence's keys, through its table."""
    keys, values = keys.cpu(), values.cpu()
    kv_heads, _, _, dim = keys.shape
    heads = q.shape[1]
    context = int(positions.max()) + 1
    key_positions = torch.arange(context)
    slots = table[key_positions // block_size] * block_size + key_positions % block_size
    k = keys.reshape(kv_heads, -1, dim)[:, slots].repeat_interleave(heads // kv_heads, 0)
    v = values.reshape(kv_heads, -1, dim)[:, slots].repeat_interleave(heads // kv_heads, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(-1, -2) * dim**-0.5  # [heads, rows, context]
    hidden = (key_positions[None, :] > positions[:, None]) | (key_positions[None, :] <= positions[:, None] - window)
    scores.masked_fill_(hidden[None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(q.shape[0], -1)


def _decode_meta(tables, lens, block_size, padded: bool) -> AttentionMetadata:
    slots = padding = None
    if padded:
        slots = (tables[:, :, None] * block_size + torch.arange(block_size)).reshape(len(lens), -1)
        padding = torch.arange(slots.shape[1])[None, :] >= lens[:, None]
    return AttentionMetadata(torch.zeros(0, dtype=torch.int64), len(lens), tables, lens, slots, padding, ())


def _decode_case(shape, fmt_name, seed, device="cpu", lens=DECODE_LENS):
    heads, kv_heads, head_dim, block_size = shape
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    cache, keys, values = _storage(kv_heads, head_dim, block_size, num_blocks, fmt_name, gen, device)
    tables = _tables(lens, block_size, num_blocks, gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    return q, cache, keys, values, tables, torch.tensor(lens)


def _check_decode(shape, fmt_name, padded: bool, seed: int) -> None:
    for lens in (DECODE_LENS, LONG_DECODE_LENS):
        _check_decode_batch(shape, fmt_name, padded, seed, lens)


def _check_decode_batch(shape, fmt_name, padded: bool, seed: int, lens: list[int]) -> None:
    q, cache, keys, values, tables, lens_tensor = _decode_case(shape, fmt_name, seed, lens=lens)
    block_size = shape[3]
    meta = _decode_meta(tables, lens_tensor, block_size, padded)
    empty = torch.zeros(0, shape[1], shape[2])
    for window in WINDOWS:
        out = paged_attention(q, empty, empty, cache.layer(0), meta, shape[2] ** -0.5, window)
        for row, n in enumerate(lens):
            want = _reference(q[row : row + 1], keys, values, tables[row], block_size, torch.tensor([n - 1]), window)
            error = (out[row].double() - want[0]).abs().max().item()
            assert error <= QUANT_TOLERANCE, (shape, fmt_name, padded, window, n, error)


@pytest.mark.parametrize("fmt_name", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_native_decode_kernel_keeps_each_window(shape, fmt_name):
    assert decode_attention_kernel() is not None, "the C kernel must build on this machine (cc is required)"
    _check_decode(shape, fmt_name, padded=False, seed=1)


@pytest.mark.parametrize("fmt_name", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_pytorch_decode_keeps_each_window(shape, fmt_name):
    # An unquantized cache takes the padded-slot path; a quantized one the chunked online softmax.
    _check_decode(shape, fmt_name, padded=fmt_name == "auto", seed=2)


def _prefill_case(shape, fmt_name, seed, device="cpu"):
    heads, kv_heads, head_dim, block_size = shape
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-ctx // block_size) for _, ctx in CHUNKS) + 2
    cache, keys, values = _storage(kv_heads, head_dim, block_size, num_blocks, fmt_name, gen, device)
    tables = _tables([ctx for _, ctx in CHUNKS], block_size, num_blocks, gen)
    q = torch.randn(sum(n for n, _ in CHUNKS), heads, head_dim, generator=gen).to(device)
    return q, cache, keys, values, tables


def _check_prefill_rows(out, q, keys, values, tables, block_size, window, label) -> None:
    row = 0
    for index, (new, ctx) in enumerate(CHUNKS):
        want = _reference(q[row : row + new].cpu(), keys.cpu(), values.cpu(), tables[index], block_size,
                          torch.arange(ctx - new, ctx), window)
        error = (out[row : row + new].cpu().double() - want).abs().max().item()
        assert error <= QUANT_TOLERANCE, (label, window, (new, ctx), error)
        row += new


@pytest.mark.parametrize("fmt_name", ["auto", "int8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_pytorch_prefill_keeps_each_window(shape, fmt_name):
    """Chunks with earlier context read the cache; a chunk without attends to its own new K/V (here the
    values already in the cache at its slots, so both views agree)."""
    q, cache, keys, values, tables = _prefill_case(shape, fmt_name, seed=3)
    _, kv_heads, head_dim, block_size = shape
    layer = cache.layer(0)
    segments, row = [], 0
    new_k, new_v, new_slots = [], [], []
    for index, (new, ctx) in enumerate(CHUNKS):
        slots = (tables[index][:, None] * block_size + torch.arange(block_size)).reshape(-1)[:ctx]
        segments.append(PrefillSegment(row, new, ctx, slots if ctx > new else None))
        own = slots[ctx - new :]
        new_slots.append(own)
        new_k.append(keys.reshape(kv_heads, -1, head_dim)[:, own].transpose(0, 1).float())
        new_v.append(values.reshape(kv_heads, -1, head_dim)[:, own].transpose(0, 1).float())
        row += new
    meta = AttentionMetadata(torch.cat(new_slots), 0, tables[:0], torch.zeros(0, dtype=torch.int64), None, None,
                             tuple(segments))
    for window in WINDOWS:
        # The new K/V are written back where they came from (a dequantized int8 value re-quantizes to
        # itself): the cache keeps the values the reference reads.
        out = paged_attention(q, torch.cat(new_k), torch.cat(new_v), layer, meta, head_dim**-0.5, window)
        _check_prefill_rows(out, q, keys, values, tables, block_size, window, (shape, fmt_name))


def check_triton(device: str = "cpu") -> None:
    """The Triton decode and prefill kernels with a window inside a block and one across several
    (fp32 caches; int8 decode too). Fewer cases than above: the interpreter is slow."""
    from engine.kernels.triton_decode import SplitPlan, paged_decode_attention
    from engine.kernels.triton_prefill import paged_prefill_attention

    windows = (7, 33)
    for index, shape in enumerate(SHAPES[:2]):
        heads, _, head_dim, block_size = shape
        for fmt_name in ("auto", "int8")[: 2 - index]:
            q, cache, keys, values, tables, lens = _decode_case(shape, fmt_name, 10 + index, device)
            layer = cache.layer(0)
            for window in windows:
                for plan in (None, SplitPlan(3, 1)):  # the kernel's own splits, and several short ones
                    out = paged_decode_attention(q.to(device), layer.k, layer.v, layer.k_scale, layer.v_scale,
                                                 tables.to(device), lens.to(device), head_dim**-0.5, plan, window)
                    for row, n in enumerate(DECODE_LENS):
                        want = _reference(q[row : row + 1], keys, values, tables[row], block_size,
                                          torch.tensor([n - 1]), window)
                        error = (out[row].cpu().double() - want[0]).abs().max().item()
                        assert error <= QUANT_TOLERANCE, ("decode", shape, fmt_name, window, plan, n, error)
        q, cache, keys, values, tables = _prefill_case(shape, "auto", 20 + index, device)
        layer = cache.layer(0)
        chunk_tables = tuple(tables[i][: -(-ctx // block_size)] for i, (_, ctx) in enumerate(CHUNKS))
        tiles = build_prefill_tiles(0, tuple(n for n, _ in CHUNKS), tuple(c for _, c in CHUNKS), chunk_tables, 16,
                                    torch.device(device))
        for window in windows:
            out = torch.zeros(q.shape[0], heads * head_dim, device=device)
            paged_prefill_attention(q.to(device), layer.k, layer.v, tiles.tiles, tiles.block_tables,
                                    tiles.rows_per_tile, tiles.max_context_len, head_dim**-0.5, out, window)
            _check_prefill_rows(out, q, keys, values, tables, block_size, window, ("prefill", shape))


def test_triton_kernels_keep_each_window_interpreted():
    from tests.engine.interpreted import run_interpreted

    run_interpreted("tests.engine.test_sliding_window_kernels", "windowed triton checks passed")


@pytest.mark.cuda
def test_triton_kernels_keep_each_window_on_cuda():
    check_triton("cuda")


if __name__ == "__main__":
    check_triton()
    print("windowed triton checks passed")
