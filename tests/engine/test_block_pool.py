"""BlockPool: allocation order, LRU eviction, prefix-hit revival, events, integrity checks."""

import pytest

from engine.block_hash import BlockHash
from engine.block_pool import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    IntegrityError,
    NoFreeBlocksError,
)


def h(n: int) -> BlockHash:
    """A fake 16-byte hash; the pool treats hashes as opaque keys."""
    return BlockHash(bytes([n]) * 16)


def make_pool(num_blocks=6):
    events = []
    return BlockPool(num_blocks, on_event=events.append), events


def test_fresh_pool_allocates_ids_in_order():
    pool, _ = make_pool()
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(0) == []
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free_blocks == 1
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    pool.check_integrity()


def test_release_appends_to_the_tail_in_the_given_order():
    pool, _ = make_pool()
    pool.allocate(3)
    pool.release([2, 1, 0])  # a sequence's blocks in reverse: its tail is evicted first
    assert pool.allocate(6) == [3, 4, 5, 2, 1, 0]
    pool.check_integrity()


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool, _ = make_pool()
    pool.allocate(4)
    with pytest.raises(NoFreeBlocksError, match="asked for 3 blocks, 2 free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [4, 5]
    pool.check_integrity()


def test_allocate_evicts_cached_blocks_lru_and_emits_removed():
    pool, events = make_pool(4)
    pool.allocate(4)
    for block_id in range(4):
        pool.mark_cached(block_id, h(block_id), [block_id] * 2)
    events.clear()
    pool.release([1, 3, 0, 2])
    assert pool.num_cached_blocks == 4
    assert pool.allocate(2) == [1, 3]
    assert events == [BlockRemoved((h(1), h(3)))]
    assert pool.lookup(h(1)) is None and pool.lookup(h(3)) is None
    assert pool.lookup(h(0)) == 0 and pool.lookup(h(2)) == 2
    assert pool.cached_tokens(1) is None
    assert pool.num_cached_blocks == 2
    pool.check_integrity()


def test_acquire_revives_a_free_cached_block_out_of_the_free_queue():
    pool, _ = make_pool(3)
    pool.allocate(3)
    pool.mark_cached(0, h(7), [1, 2])
    pool.release([0, 1, 2])
    assert pool.lookup(h(7)) == 0 and pool.cached_tokens(0) == (1, 2)
    pool.acquire([0])
    assert pool.ref_count(0) == 1 and not pool.is_free(0)
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [1, 2]  # the revived block is not handed out again
    pool.check_integrity()


def test_acquire_in_use_block_shares_it():
    pool, _ = make_pool(2)
    pool.allocate(1)
    pool.acquire([0])
    assert pool.ref_count(0) == 2
    pool.release([0])
    assert pool.ref_count(0) == 1 and pool.num_free_blocks == 1
    pool.release([0])
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_acquire_free_uncached_block_is_refused_atomically():
    pool, _ = make_pool(3)
    pool.allocate(1)
    with pytest.raises(ValueError, match="block 2 is free and not cached"):
        pool.acquire([0, 2])
    assert pool.ref_count(0) == 1  # the valid id in the same call was not taken either
    pool.check_integrity()


def test_over_release_is_refused_atomically():
    pool, _ = make_pool(3)
    pool.allocate(2)
    with pytest.raises(ValueError, match="block 1 released 2x with ref count 1"):
        pool.release([0, 1, 1])
    assert [pool.ref_count(b) for b in range(3)] == [1, 1, 0]
    with pytest.raises(ValueError, match="block id must be in"):
        pool.release([3])
    pool.check_integrity()


def test_mark_cached_duplicate_hash_keeps_the_existing_block():
    pool, events = make_pool(3)
    pool.allocate(2)
    pool.mark_cached(0, h(1), [5, 6])
    pool.mark_cached(1, h(1), [5, 6])  # same content computed twice concurrently
    assert pool.lookup(h(1)) == 0
    assert pool.cached_tokens(1) is None
    assert pool.num_cached_blocks == 1
    assert events == [BlockStored((h(1),), None, (5, 6))]
    pool.release([1])
    assert pool.allocate(2) == [2, 1]  # the uncached duplicate is recycled without any event
    assert len(events) == 1
    pool.check_integrity()


def test_mark_cached_rules():
    pool, events = make_pool(2)
    pool.allocate(1)
    pool.mark_cached(0, h(1), [5, 6], parent_hash=h(9))
    pool.mark_cached(0, h(1), [5, 6])  # idempotent: no second event
    assert events == [BlockStored((h(1),), h(9), (5, 6))]
    with pytest.raises(ValueError, match="already cached under another hash"):
        pool.mark_cached(0, h(2), [5, 6])
    with pytest.raises(ValueError, match="block 1 is free"):
        pool.mark_cached(1, h(3), [7, 8])
    pool.check_integrity()


def test_reset_prefix_cache_drops_only_free_blocks():
    pool, events = make_pool(3)
    pool.allocate(3)
    for block_id in range(3):
        pool.mark_cached(block_id, h(block_id), [block_id])
    pool.release([2, 0])
    events.clear()
    pool.reset_prefix_cache()
    assert events == [BlockRemoved((h(2), h(0)))]
    assert pool.lookup(h(1)) == 1
    assert pool.lookup(h(0)) is None and pool.lookup(h(2)) is None
    pool.reset_prefix_cache()
    assert len(events) == 1  # nothing left to drop, nothing emitted
    pool.check_integrity()


def test_events_are_emitted_in_order():
    pool, events = make_pool(2)
    pool.allocate(2)
    pool.mark_cached(0, h(1), [1])
    pool.mark_cached(1, h(2), [2], parent_hash=h(1))
    pool.release([1, 0])
    pool.allocate(1)
    pool.allocate(1)
    assert events == [
        BlockStored((h(1),), None, (1,)),
        BlockStored((h(2),), h(1), (2,)),
        BlockRemoved((h(2),)),
        BlockRemoved((h(1),)),
    ]


def test_no_callback_is_fine():
    pool = BlockPool(2)
    pool.allocate(1)
    pool.mark_cached(0, h(1), [1])
    pool.release([0])
    assert pool.allocate(2) == [1, 0]
    pool.check_integrity()


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_num_blocks_validation(bad):
    with pytest.raises(ValueError):
        BlockPool(bad)


def _corrupt_negative_ref(pool):
    pool._ref_counts[3] = -1


def _corrupt_used_block_in_free_queue(pool):
    pool._free[0] = None


def _corrupt_free_block_missing_from_queue(pool):
    pool._ref_counts[1] = 0  # block 1 is in use: a count of 0 says free, but no queue holds it


def _corrupt_hash_map_points_elsewhere(pool):
    pool._hash_to_block[h(1)] = 1


def _corrupt_stale_hash_entry(pool):
    pool._hash_to_block[h(9)] = 2


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_corrupt_negative_ref, "negative ref count"),
        (_corrupt_used_block_in_free_queue, "block 0 .* free queue iff"),
        (_corrupt_free_block_missing_from_queue, "block 1 .* free queue iff"),
        (_corrupt_hash_map_points_elsewhere, "does not map back"),
        (_corrupt_stale_hash_entry, "differ in size"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message):
    pool, _ = make_pool(6)
    pool.allocate(2)
    pool.mark_cached(0, h(1), [1])
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(IntegrityError, match=message):
        pool.check_integrity()


def test_mark_cached_chain_announces_each_run_of_new_blocks_once():
    """Blocks 0-4 of one sequence; hash 3 is already cached in block 5 (another sequence computed it), so
    the chain caches 0-2 and 4 as two runs, each naming the hash before it as its parent."""
    pool, events = make_pool(8)
    pool.allocate(6)
    pool.mark_cached(5, h(3), [3])
    events.clear()
    pool.mark_cached_chain([0, 1, 2, 3, 4], [h(0), h(1), h(2), h(3), h(4)], [[0], [1], [2], [3], [4]], parent_hash=h(9))
    assert events == [
        BlockStored((h(0), h(1), h(2)), h(9), (0, 1, 2)),
        BlockStored((h(4),), h(3), (4,)),
    ]
    assert [pool.lookup(h(i)) for i in range(5)] == [0, 1, 2, 5, 4]
    pool.mark_cached_chain([0, 1], [h(0), h(1)])  # already cached: nothing new, nothing announced
    assert len(events) == 2
    pool.check_integrity()


def test_mark_cached_chain_announces_what_it_cached_before_a_bad_block():
    pool, events = make_pool(4)
    pool.allocate(2)
    with pytest.raises(ValueError, match="block 3 is free"):
        pool.mark_cached_chain([0, 1, 3], [h(0), h(1), h(2)])
    assert events == [BlockStored((h(0), h(1)), None, ())]
    pool.check_integrity()


def test_release_checks_every_id_before_releasing_any():
    pool, _ = make_pool(4)
    pool.allocate(3)
    for bad, message in (([0, 7], "block id must be in"), ([0, 3], "ref count 0"), ([1, 1], "released 2x")):
        with pytest.raises(ValueError, match=message):
            pool.release(bad)
        assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    pool.release([2, 0])
    assert pool.allocate(3) == [3, 2, 0]  # the fresh block first, then the freed ones in release order
    pool.check_integrity()
