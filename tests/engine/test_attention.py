"""Paged attention: the native decode kernel equals the PyTorch reference path on the same cache,
for MHA/GQA/MQA, ragged contexts, and block tables in any order; over an int8 / fp8 cache both
kernels equal attention over the dequantized values, and stay within a stated tolerance of fp32."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.attention import AttentionMetadata, _decode_attention, _decode_attention_native, attend_after_context
from engine.kernels import decode_attention_kernel
from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from engine.quantized_attention import quantized_decode_attention, quantized_prefill_attention

LENS = [1, 7, 16, 17, 63, 200]
SHAPES = [(4, 4, 16, 16), (12, 4, 64, 16), (8, 2, 64, 16), (4, 4, 64, 4), (8, 1, 32, 4), (6, 2, 128, 8),
          (2, 2, 8, 1)]
# Attention over a quantized cache vs the same attention over the fp32 values, K and V ~ N(0, 1),
# scores scaled by 1/sqrt(head_dim): the largest output error seen over SHAPES and 3 seeds was 0.017
# (int8) and 0.118 (fp8: 3 mantissa bits); the bounds leave ~2x headroom. Outputs are convex mixtures
# of V rows (|o| <~ 3).
QUANT_TOLERANCE = {"int8": 0.035, "fp8": 0.25}


def _case(heads, kv_heads, head_dim, block_size, lens, kv_cache_dtype="auto", seed=0):
    """(q, storage, fp32 storage with the unquantized values, padded-path metadata, kernel metadata)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 3
    cache = KVCacheStorage(kv_format(kv_cache_dtype, torch.float32), 1, kv_heads, num_blocks, block_size, head_dim)
    exact = KVCacheStorage(kv_format("auto", torch.float32), 1, kv_heads, num_blocks, block_size, head_dim)
    k = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    for storage in (cache, exact):
        storage.layer(0).write(k, v, torch.arange(num_blocks * block_size))
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered over the pool
    width = max((n + block_size - 1) // block_size for n in lens)
    tables, used = [], 0
    for n in lens:
        count = (n + block_size - 1) // block_size
        tables.append(order[used:used + count] + [0] * (width - count))
        used += count
    tables = torch.tensor(tables, dtype=torch.int64)
    context = torch.tensor(lens, dtype=torch.int64)
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).reshape(len(lens), -1)
    padding = torch.arange(slots.shape[1])[None, :] >= context[:, None]
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    padded = AttentionMetadata(None, len(lens), tables, context, slots, padding, ())
    native = AttentionMetadata(None, len(lens), tables, context, None, None, ())
    return q, cache, exact, padded, native


def _dequantized(cache: KVCacheStorage) -> KVCacheStorage:
    """An fp32 storage holding exactly the values a quantized one dequantizes to."""
    layer = cache.layer(0)
    out = KVCacheStorage(kv_format("auto", torch.float32), 1, *layer.k.shape[:3], layer.k.shape[3])
    out.layer(0).k.copy_(cache.fmt.dequantize(layer.k, layer.k_scale))
    out.layer(0).v.copy_(cache.fmt.dequantize(layer.v, layer.v_scale))
    return out


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
def test_native_decode_kernel_equals_reference(heads, kv_heads, head_dim, block_size):
    assert decode_attention_kernel() is not None, "the C kernel must build on this machine (cc is required)"
    q, cache, _, padded, native_meta = _case(heads, kv_heads, head_dim, block_size, LENS)
    layer = cache.layer(0)
    reference = _decode_attention(q, layer.k, layer.v, padded, head_dim ** -0.5)
    native = _decode_attention_native(q, layer, native_meta, head_dim ** -0.5)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", SHAPES)
def test_both_kernels_read_a_quantized_cache_directly(kv_cache_dtype, heads, kv_heads, head_dim, block_size):
    q, cache, exact, padded, native_meta = _case(heads, kv_heads, head_dim, block_size, LENS, kv_cache_dtype)
    scale = head_dim ** -0.5
    dequantized = _dequantized(cache).layer(0)
    on_dequantized = _decode_attention(q, dequantized.k, dequantized.v, padded, scale)
    torch_path = quantized_decode_attention(q, cache.layer(0), padded.decode_block_tables,
                                            padded.decode_context_lens, scale)
    native = _decode_attention_native(q, cache.layer(0), native_meta, scale)
    # Both read int8 / fp8 values in place: equal to attention over the dequantized values, up to
    # summation order ...
    torch.testing.assert_close(torch_path, on_dequantized, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(native, on_dequantized, rtol=1e-5, atol=2e-6)
    # ... and within the format's stated tolerance of attention over the fp32 values.
    fp32 = _decode_attention(q, exact.layer(0).k, exact.layer(0).v, padded, scale)
    assert (native - fp32).abs().max() <= QUANT_TOLERANCE[kv_cache_dtype]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_prefill_over_cached_context_matches_the_reference(kv_cache_dtype):
    """A prefill chunk attending to earlier cached tokens (prefix hit, chunked prefill) reads the
    quantized cache causally, chunk by chunk."""
    heads, kv_heads, head_dim, block_size, context_len, query_len = 8, 2, 32, 4, 150, 37
    q_all, cache, _, padded, _ = _case(heads, kv_heads, head_dim, block_size, [context_len], kv_cache_dtype)
    table = padded.decode_block_tables[0]
    context_slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:context_len]
    q = torch.randn(query_len, heads, head_dim, generator=torch.Generator().manual_seed(3))
    got = quantized_prefill_attention(q, cache.layer(0), context_slots, context_len, head_dim ** -0.5)
    dequantized = _dequantized(cache).layer(0)
    keys = dequantized.k.reshape(kv_heads, -1, head_dim)[:, context_slots].repeat_interleave(heads // kv_heads, 0)
    values = dequantized.v.reshape(kv_heads, -1, head_dim)[:, context_slots].repeat_interleave(heads // kv_heads, 0)
    first = context_len - query_len
    allowed = torch.arange(context_len)[None, :] <= torch.arange(first, context_len)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=allowed, scale=head_dim ** -0.5)
    torch.testing.assert_close(got, expected.transpose(0, 1).reshape(query_len, -1), rtol=1e-5, atol=2e-6)


def test_native_kernel_uses_any_thread_count():
    q, cache, _, _, native_meta = _case(12, 4, 64, 16, [5, 90, 300, 33, 2], "int8", seed=1)
    outputs = []
    for threads in (1, 2, 7):
        torch.set_num_threads(threads)
        outputs.append(_decode_attention_native(q, cache.layer(0), native_meta, 0.125))
    torch.set_num_threads(2)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_torch_path_can_be_forced():
    code = ("from engine.kernels import decode_attention_kernel; "
            "assert decode_attention_kernel() is None; print('fallback')")
    result = subprocess.run([sys.executable, "-c", code], env={"SPLITSERVE_ATTENTION": "torch",
                            "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "fallback" in result.stdout, result.stderr


@pytest.mark.parametrize("heads, kv_heads, query_len, context_len", [(8, 2, 37, 150), (4, 4, 1, 9), (6, 1, 16, 16)])
def test_a_chunk_over_its_context_sees_keys_up_to_its_own_position(heads, kv_heads, query_len, context_len):
    """attend_after_context (causal_lower_right) equals the explicit mask: query i sits at context_len -
    query_len + i, for GQA/MQA, one query, and a chunk with no earlier context."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, heads, query_len, 16, generator=gen)
    k, v = (torch.randn(1, kv_heads, context_len, 16, generator=gen) for _ in range(2))
    first = context_len - query_len
    allowed = torch.arange(context_len)[None, :] <= torch.arange(first, context_len)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1),
        attn_mask=allowed, scale=0.25)
    torch.testing.assert_close(attend_after_context(q, k, v, 0.25), expected, rtol=1e-6, atol=1e-6)
    # What the CUDA path passes instead of the mask: the same attention.
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(query_len, context_len)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
