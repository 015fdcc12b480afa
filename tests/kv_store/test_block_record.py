"""A block record carries one block's KV bit for bit, and anything else is refused: corrupt bytes,
another block's hash, another layout."""

from __future__ import annotations

import pytest
import torch

from engine.block_hash import HashNamespace, hash_blocks
from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from kv_store.block_record import BlockCodec, block_key

pytestmark = pytest.mark.timeout(60)


def _storage(kv_cache_dtype: str, heads: int = 2, planes: int = 2) -> KVCacheStorage:
    storage = KVCacheStorage(kv_format(kv_cache_dtype, torch.float32), 3, heads, 6, 4, 8, planes=planes)
    generator = torch.Generator().manual_seed(0)
    raw = torch.randint(-100, 100, storage.values.shape, generator=generator)
    storage.values.copy_(raw.to(torch.float32).div(7) if storage.values.is_floating_point() else raw.to(torch.int8))
    if storage.scales is not None:
        storage.scales.copy_(torch.rand(storage.scales.shape, generator=generator))
    return storage


def _hashes(count: int):
    return hash_blocks(HashNamespace("model-a", 4, ""), list(range(count * 4)))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("planes", [2, 1])
def test_records_move_blocks_bit_for_bit_into_other_block_ids(kv_cache_dtype, planes):
    source, target = _storage(kv_cache_dtype, planes=planes), _storage(kv_cache_dtype, planes=planes)
    target.values.zero_()
    codec, hashes = BlockCodec(source), _hashes(3)
    records = [codec.encode(block, block_hash) for block, block_hash in zip((1, 4, 2), hashes, strict=True)]
    assert all(len(record) == codec.record_bytes for record in records)
    assert all(codec.check(record, block_hash) for record, block_hash in zip(records, hashes, strict=True))

    BlockCodec(target).decode_into((5, 0, 3), records)
    for src, dst in ((1, 5), (4, 0), (2, 3)):
        assert torch.equal(source.values[:, :, :, src].view(torch.uint8), target.values[:, :, :, dst].view(torch.uint8))
        if source.scales is not None:
            assert torch.equal(source.scales[:, :, :, src], target.scales[:, :, :, dst])
    untouched = [b for b in range(6) if b not in (5, 0, 3)]
    assert not target.values[:, :, :, untouched].view(torch.uint8).any()


def test_a_corrupt_record_another_hash_or_another_layout_is_refused():
    storage = _storage("int8")
    codec, (first, second) = BlockCodec(storage), _hashes(2)
    record = codec.encode(2, first)
    flipped = bytearray(record)
    flipped[-5] ^= 0x01
    assert not codec.check(bytes(flipped), first)
    assert not codec.check(record[:-1], first)
    assert not codec.check(record, second)
    assert not codec.check(None, first)
    other = BlockCodec(_storage("auto"))  # same model, other KV dtype: other key, and the record is refused
    assert not other.check(record, first)
    assert other.key(first) != codec.key(first)
    assert BlockCodec(_storage("int8", heads=4)).key(first) != codec.key(first)
    assert codec.key(first) == block_key(codec.layout, first)


def test_keys_of_two_tenants_differ_for_the_same_tokens():
    codec = BlockCodec(_storage("auto"))
    tokens = list(range(8))
    a = hash_blocks(HashNamespace("model-a", 4, "tenant-a"), tokens)
    b = hash_blocks(HashNamespace("model-a", 4, "tenant-b"), tokens)
    assert {codec.key(h) for h in a}.isdisjoint(codec.key(h) for h in b)
