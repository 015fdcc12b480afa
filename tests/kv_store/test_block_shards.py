"""Head-shard records of a tensor-parallel decode instance: each rank's heads of a block, written on
its own, join into the whole record a single-rank pool reads, bit for bit; a shard missing, corrupt or
of another layout makes the block a miss; shard keys never collide with whole keys or other layouts."""

from __future__ import annotations

import pytest

from common.kv_store_config import KVStoreConfig
from engine.kv_storage import KVCacheStorage
from kv_store.block_record import HEADER_BYTES, BlockCodec, HeadRange
from kv_store.block_shards import ShardAssembler, head_ranges, rank_heads, writes_shards
from kv_store.host_tier import MemoryTier
from kv_store.tiers import StoreWriter
from kv_store.worker_tiers import WorkerKVTiers
from tests.kv_store.test_block_record import _hashes, _storage

pytestmark = pytest.mark.timeout(60)


def _rank_storage(whole: KVCacheStorage, heads: HeadRange) -> KVCacheStorage:
    """What one TP rank holds: the same blocks, only heads [start, end)."""
    rank = KVCacheStorage(
        whole.fmt, whole.num_layers, heads.end - heads.start, whole.num_blocks, 4, 8, planes=whole.planes
    )
    rank.values.copy_(whole.values[:, :, heads.start : heads.end])
    if whole.scales is not None:
        assert rank.scales is not None
        rank.scales.copy_(whole.scales[:, :, heads.start : heads.end])
    return rank


def test_head_ranges_follow_the_hand_off_split():
    assert head_ranges(4, 1) == [HeadRange(0, 4, 4)]
    assert head_ranges(4, 2) == [HeadRange(0, 2, 4), HeadRange(2, 4, 4)]
    assert head_ranges(4, 4) == [HeadRange(i, i + 1, 4) for i in range(4)]
    assert head_ranges(2, 8) == [HeadRange(0, 1, 2), HeadRange(1, 2, 2)]  # four replicas of each head
    assert [rank_heads(r, 2, 8).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [writes_shards(r, 2, 8) for r in range(8)] == [True, False, False, False, True, False, False, False]
    assert head_ranges(1, 4) == [HeadRange(0, 1, 1)]  # an MLA latent: every rank holds it whole
    assert all(writes_shards(r, 4, 4) for r in range(4))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_shards_of_every_rank_assemble_into_the_whole_record_bit_for_bit(kv_cache_dtype, tp_size):
    whole = _storage(kv_cache_dtype, heads=4)
    codec, hashes = BlockCodec(whole), _hashes(2)
    ranges = head_ranges(4, tp_size)
    ranks = [BlockCodec(_rank_storage(whole, heads), heads) for heads in ranges]
    assembler = ShardAssembler(BlockCodec(_storage(kv_cache_dtype, heads=4)), ranges)
    for block, block_hash in zip((1, 4), hashes, strict=True):
        shards = [rank.encode(block, block_hash) for rank in ranks]
        assert [len(s) for s in shards] == [len(shards[0])] * tp_size
        assert len(shards[0]) - HEADER_BYTES == (codec.record_bytes - HEADER_BYTES) // tp_size  # heads split evenly
        assert all(assembler.check(i, s, block_hash) for i, s in enumerate(shards))
        assert assembler.keys(block_hash) == [rank.key(block_hash) for rank in ranks]
        assert assembler.assemble(block_hash, shards) == codec.encode(block, block_hash)


def test_a_corrupt_foreign_or_misplaced_shard_is_refused_and_keys_never_collide():
    whole = _storage("int8", heads=4)
    (first, second) = _hashes(2)
    two, four = head_ranges(4, 2), head_ranges(4, 4)
    rank0 = BlockCodec(_rank_storage(whole, two[0]), two[0])
    assembler = ShardAssembler(BlockCodec(whole), two)
    shard = rank0.encode(3, first)
    flipped = bytearray(shard)
    flipped[-1] ^= 0x01
    assert assembler.check(0, shard, first)
    assert not assembler.check(0, bytes(flipped), first)
    assert not assembler.check(1, shard, first), "rank 0's heads are not rank 1's"
    assert not assembler.check(0, shard, second)
    assert not assembler.check(0, None, first)
    keys = {BlockCodec(whole).key(first)} | {
        k for ranges in (two, four) for k in ShardAssembler(BlockCodec(whole), ranges).keys(first)
    }
    assert len(keys) == 1 + 2 + 4, "whole, tp=2 and tp=4 records of one block: seven distinct keys"
    other_dtype = ShardAssembler(BlockCodec(_storage("auto", heads=4)), two)
    assert not set(other_dtype.keys(first)) & keys
    assert not other_dtype.check(0, shard, first)
    with pytest.raises(ValueError, match="do not split 4 heads"):
        ShardAssembler(BlockCodec(whole), [two[1], two[0]])


def test_a_reader_assembles_shard_runs_after_whole_blocks_and_stops_at_a_bad_shard():
    """A migrated request's chain: prompt blocks as whole records, generated ones as shards of two ranks."""
    whole = _storage("int8", heads=4)
    hashes = _hashes(5)
    two = head_ranges(4, 2)
    config = KVStoreConfig(host_tier_bytes=1 << 20, host_tier="memory")
    reader = WorkerKVTiers(config, _storage("int8", heads=4), None, decode_tp_size=2)
    tier = reader.tiers[0]
    assert isinstance(tier, MemoryTier)
    codec = BlockCodec(whole)
    writer = StoreWriter([tier])
    writer.submit([(codec.key(h), codec.encode(b, h)) for b, h in zip((0, 1), hashes[:2], strict=True)])
    for heads in two:
        rank = BlockCodec(_rank_storage(whole, heads), heads)
        writer.submit([(rank.key(h), rank.encode(b, h)) for b, h in zip((2, 3, 4), hashes[2:], strict=True)])
    assert writer.flush(5.0)
    got = reader.fetch(hashes)
    assert got == [codec.encode(b, h) for b, h in zip(range(5), hashes, strict=True)]
    assert reader.blocks_assembled == 3
    rank1_key = BlockCodec(_rank_storage(whole, two[1]), two[1]).key(hashes[3])
    record = bytearray(tier.get_many([rank1_key])[0] or b"")
    record[-1] ^= 0xFF
    tier.put_many([(rank1_key, bytes(record))])
    assert reader.fetch(hashes) == got[:3], "block 3's second shard is corrupt: the run ends before it"
    assert reader.records_refused == 1
    writer.close()
    reader.close()


def test_a_reader_reports_the_shard_layouts_it_assembles_from():
    """What the router prices shard-held blocks by (`StoreReads.shard_layouts`): the layouts the ranks of
    a TP decode instance write their shards under, in head order; none when decode writes whole records."""
    config = KVStoreConfig(host_tier_bytes=1 << 20, host_tier="memory")
    whole = _storage("int8", heads=4)
    reader = WorkerKVTiers(config, _storage("int8", heads=4), None, decode_tp_size=2)
    ranks = [BlockCodec(_rank_storage(whole, heads), heads) for heads in head_ranges(4, 2)]
    assert reader.reads().shard_layouts == tuple(rank.layout.hex() for rank in ranks)
    assert reader.reads().layout == BlockCodec(whole).layout.hex()
    single = WorkerKVTiers(config, _storage("int8", heads=4), None, decode_tp_size=1)
    assert single.reads().shard_layouts == ()
    reader.close()
    single.close()
