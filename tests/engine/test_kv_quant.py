"""KV cache formats and the storage object: quantize-dequantize round trips stay within each format's
stated bound, pools hold proportionally more blocks, and blocks move between storages bit for bit."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kv_quant import KV_CACHE_DTYPES, kv_format
from engine.kv_storage import KVCacheStorage
from engine.model_loader import load_engine_model_config, load_model_config
from tests.factories import TinySpec


def _head_vectors(seed: int = 0) -> torch.Tensor:
    """[tokens, heads, head_dim] with the shapes that break quantizers: gaussian rows, one huge outlier
    per row, tiny magnitudes, an all-zero row, and a row of one repeated value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, 32, generator=gen)
    x[:8, :, 3] *= 200.0
    x[8:16] *= 1e-6
    x[16] = 0.0
    x[17] = -2.5
    x[18:24] *= 1e4
    return x


def test_int8_round_trip_error_is_within_half_a_step():
    fmt = kv_format("int8", torch.float32)
    x = _head_vectors()
    values, scale = fmt.quantize(x)
    assert values.dtype == torch.int8 and scale.shape == x.shape[:-1] and scale.dtype == torch.float32
    error = (fmt.dequantize(values, scale) - x).abs()
    assert torch.all(error <= scale[..., None] / 2 * (1 + 1e-6))
    assert torch.equal(fmt.dequantize(values, scale)[16], x[16])  # zeros stay exact
    assert values.abs().max() == 127


def test_fp8_round_trip_error_is_within_its_bound():
    fmt = kv_format("fp8", torch.float32)
    x = _head_vectors(1)
    values, scale = fmt.quantize(x)
    assert values.dtype == torch.float8_e4m3fn
    error = (fmt.dequantize(values, scale) - x).abs()
    # 3 mantissa bits: half an ulp is 1/16 of the value for normals; subnormals step by scale * 2^-9.
    bound = torch.maximum(x.abs() / 16, scale[..., None] / 1024)
    assert torch.all(error <= bound * (1 + 1e-6))
    assert values.float().abs().max() == 448


def test_auto_is_the_model_dtype_and_stores_values_as_they_are():
    for dtype in (torch.float32, torch.bfloat16):
        fmt = kv_format("auto", dtype)
        assert fmt.storage_dtype == dtype and not fmt.quantized
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        kv_format("int4", torch.float32)
    assert KV_CACHE_DTYPES == ("auto", "int8", "fp8")


@pytest.mark.parametrize("head_dim, ratio_max", [(64, 0.27), (128, 0.26)])
def test_int8_bytes_per_token_and_blocks_per_pool(head_dim, ratio_max):
    fp32 = kv_format("auto", torch.float32).bytes_per_token(2, 4, head_dim)
    for name in ("int8", "fp8"):
        quantized = kv_format(name, torch.float32).bytes_per_token(2, 4, head_dim)
        assert quantized == 2 * 2 * 4 * (head_dim + 4)  # 1 byte per value + an fp32 scale per head vector
        assert quantized / fp32 <= ratio_max


def test_pool_holds_proportionally_more_blocks(checkpoint):
    model_dir = checkpoint(TinySpec(head_dim=16))
    model = load_model_config(model_dir)
    memory = 1 << 20
    blocks = {name: EngineConfig(model_dir=str(model_dir), kv_cache_dtype=name, kv_cache_memory_bytes=memory,
                                 max_num_seqs=4096).num_blocks_for(model) for name in KV_CACHE_DTYPES}
    per_block = {name: kv_format(name, torch.float32).bytes_per_token(2, 2, 16) * 16 for name in KV_CACHE_DTYPES}
    assert blocks == {name: memory // per_block[name] for name in KV_CACHE_DTYPES}
    assert blocks["int8"] == blocks["fp8"] and blocks["int8"] / blocks["auto"] >= 3.1  # 64 / 20 bytes


def test_identity_names_the_kv_format(checkpoint):
    model_dir = str(checkpoint(TinySpec()))
    identities = {name: load_engine_model_config(EngineConfig(model_dir=model_dir, kv_cache_dtype=name)).identity
                  for name in KV_CACHE_DTYPES}
    base = load_model_config(model_dir).identity
    assert identities == {"auto": f"{base}/kv-float32", "int8": f"{base}/kv-int8", "fp8": f"{base}/kv-fp8"}


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_blocks_move_between_storages_bit_for_bit(name):
    fmt = kv_format(name, torch.float32)
    source = KVCacheStorage(fmt, 3, 4, 10, 4, 8)
    gen = torch.Generator().manual_seed(5)
    for layer in range(3):
        source.layer(layer).write(torch.randn(40, 4, 8, generator=gen), torch.randn(40, 4, 8, generator=gen),
                                  torch.randperm(40, generator=gen))
    target = KVCacheStorage(fmt, 3, 4, 6, 4, 8)
    target.copy_blocks_from(source, [7, 2, 5], [0, 4, 1])
    for layer in range(3):
        for ours, theirs in zip(target.layer(layer)[:4], source.layer(layer)[:4]):
            if ours is not None:
                assert torch.equal(ours[:, [0, 4, 1]].view(torch.uint8), theirs[:, [7, 2, 5]].view(torch.uint8))
    # A decode rank holding heads [2, 4) of the sender's: the message carries only those heads.
    rank_slice = KVCacheStorage(fmt, 3, 2, 6, 4, 8)
    index = torch.tensor([7, 2])
    for layer in range(3):
        message = source.export_layer(layer, 2, 4, index)
        assert [t.shape for t in message] == [t.shape for t in rank_slice.staging(2)]
        rank_slice.import_layer(layer, torch.tensor([3, 0]), message)
        assert torch.equal(rank_slice.layer(layer).k[:, [3, 0]].view(torch.uint8),
                           source.layer(layer).k[2:4, [7, 2]].view(torch.uint8))
    assert source.bytes_per_block == source.bytes_per_token * 4 == fmt.bytes_per_token(3, 4, 8) * 4
    assert name.replace("auto", "float32") in source.layout


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [3, 4, 6, 64])
def test_writes_and_moves_are_bit_exact_at_any_row_width(name, model_dtype, head_dim):
    """Writes and imports copy through wider integer views when a row's bytes allow (kv_storage._wide):
    the bytes land where a slot-by-slot copy puts them, whatever the head_dim and element size."""
    fmt = kv_format(name, model_dtype)
    kv = KVCacheStorage(fmt, 1, 2, 5, 4, head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    k, v = (torch.randn(7, 2, head_dim, generator=gen).to(model_dtype) for _ in range(2))
    slots = torch.tensor([19, 0, 5, 6, 11, 2, 13])
    kv.layer(0).write(k, v, slots)
    for cache, new in ((kv.layer(0).k, k), (kv.layer(0).v, v)):
        values, _ = fmt.quantize(new)
        flat = cache.reshape(2, 20, head_dim)
        for i, slot in enumerate(slots.tolist()):
            assert torch.equal(flat[:, slot].view(torch.uint8), values[i].view(torch.uint8))
    # a message's layer into other blocks, then back out: the same bytes
    other = KVCacheStorage(fmt, 1, 2, 5, 4, head_dim)
    other.import_layer(0, torch.tensor([3, 1]), kv.export_layer(0, 0, 2, torch.tensor([4, 0])))
    again = other.export_layer(0, 0, 2, torch.tensor([3, 1]))
    for ours, theirs in zip(again, kv.export_layer(0, 0, 2, torch.tensor([4, 0])), strict=True):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
