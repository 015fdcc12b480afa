"""Paged attention: the native decode kernel equals the PyTorch reference path on the same cache,
for MHA/GQA/MQA, ragged contexts, and block tables in any order."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.attention import AttentionMetadata, _decode_attention, _decode_attention_native
from engine.kernels import decode_attention_kernel


def _case(heads, kv_heads, head_dim, block_size, lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 3
    k_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen)
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
    return q, k_cache, v_cache, AttentionMetadata(None, len(lens), tables, context, slots, padding, ())


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (4, 4, 16, 16), (12, 4, 64, 16), (8, 2, 64, 16), (4, 4, 64, 4), (8, 1, 32, 4), (6, 2, 128, 8),
    (2, 2, 8, 1)])
def test_native_decode_kernel_equals_reference(heads, kv_heads, head_dim, block_size):
    assert decode_attention_kernel() is not None, "the C kernel must build on this machine (cc is required)"
    q, k_cache, v_cache, meta = _case(heads, kv_heads, head_dim, block_size, [1, 7, 16, 17, 63, 200])
    native_meta = AttentionMetadata(None, meta.num_decode_tokens, meta.decode_block_tables,
                                    meta.decode_context_lens, None, None, ())
    reference = _decode_attention(q, k_cache, v_cache, meta, head_dim ** -0.5)
    native = _decode_attention_native(q, k_cache, v_cache, native_meta, head_dim ** -0.5)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


def test_native_kernel_uses_any_thread_count():
    q, k_cache, v_cache, meta = _case(12, 4, 64, 16, [5, 90, 300, 33, 2], seed=1)
    native_meta = AttentionMetadata(None, 5, meta.decode_block_tables, meta.decode_context_lens, None, None, ())
    outputs = []
    for threads in (1, 2, 7):
        torch.set_num_threads(threads)
        outputs.append(_decode_attention_native(q, k_cache, v_cache, native_meta, 0.125))
    torch.set_num_threads(2)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_torch_path_can_be_forced():
    code = ("from engine.kernels import decode_attention_kernel; "
            "assert decode_attention_kernel() is None; print('fallback')")
    result = subprocess.run([sys.executable, "-c", code], env={"SPLITSERVE_ATTENTION": "torch",
                            "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "fallback" in result.stdout, result.stderr
