"""A rank > 0 of a TP decode instance pairs the blocks its steps filled with the hashes rank 0 names, in
either order, and stores exactly its copy of each; a copy a hand-off is about to overwrite is given up,
a copy or name never paired ages out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.kv_store_config import KVStoreConfig
from common.messages import FilledBlocks
from decode_worker.shard_store import MAX_COPY_AGE_MESSAGES, FollowerShards, filled_blocks
from kv_store.block_record import BlockCodec
from kv_store.block_shards import rank_heads
from kv_store.worker_tiers import WorkerKVTiers
from tests.kv_store.test_block_record import _hashes, _storage

pytestmark = pytest.mark.timeout(60)
BLOCK = 4  # the test storage's block size


def _step(*slots: int):
    return SimpleNamespace(slot_mapping=torch.tensor(slots, dtype=torch.int64))


def _rank1():
    storage = _storage("int8", heads=2)  # rank 1 of TP 2 over 4 KV heads
    heads = rank_heads(1, 4, 2)
    tiers = WorkerKVTiers(KVStoreConfig(host_tier_bytes=1 << 20, host_tier="memory"), storage, None, heads=heads)
    return storage, tiers, FollowerShards(tiers, BLOCK)


def test_filled_blocks_are_those_whose_last_slot_the_step_writes():
    # decode rows write slots 7 (block 1's last), 9, 15 (block 3's last); a chunk writes 16..19 (block 4 whole)
    assert filled_blocks(_step(7, 9, 15, 16, 17, 18, 19), BLOCK) == {1, 3, 4}
    assert filled_blocks(_step(0, 5, 10), BLOCK) == frozenset()


@pytest.mark.parametrize("named_first", [False, True])
def test_a_named_copy_is_stored_with_the_kv_of_the_step_that_filled_it(named_first):
    storage, tiers, shards = _rank1()
    codec: BlockCodec = tiers.codec
    (h1, h3) = _hashes(2)
    names = FilledBlocks((10, 10), (1, 3), (bytes(h1), bytes(h3)))
    expected = {codec.key(h1): codec.encode(1, h1), codec.key(h3): codec.encode(3, h3)}
    if named_first:  # rank 0's names may arrive before this rank finished the step
        shards.on_filled(names)
    shards.before_forward(10, _step(7, 15))
    shards.after_forward(10)
    storage.values.add_(1)  # what the blocks hold later is not what is stored
    if not named_first:
        shards.on_filled(names)
    assert tiers.writer.flush(5.0)
    assert tiers.reader.fetch_chain(list(expected)) == list(expected.values())
    assert tiers.blocks_stored == 2


def test_a_copy_is_stored_only_under_its_own_step_and_a_block_about_to_be_overwritten_is_given_up():
    _, tiers, shards = _rank1()
    codec = tiers.codec
    (h1, h2, h3) = _hashes(3)
    shards.before_forward(20, _step(7, 11))  # blocks 1 and 2 fill in step 20 ...
    shards.before_import([2, 5])  # ... but block 2 is freed and reserved for a hand-off before it was copied
    shards.after_forward(20)
    assert shards.copies_given_up == 1
    shards.on_filled(FilledBlocks((19, 20, 20), (1, 1, 2), (bytes(h3), bytes(h1), bytes(h2))))
    assert tiers.writer.flush(5.0)
    assert tiers.blocks_stored == 1, "only block 1 of step 20: not step 19's name, not the given-up block 2"
    keys = [codec.key(h1), codec.key(h2), codec.key(h3)]
    assert [r is not None for r in tiers.tiers[0].get_many(keys)] == [True, False, False]


def test_unpaired_copies_and_names_age_out():
    _, tiers, shards = _rank1()
    (h1,) = _hashes(1)
    shards.before_forward(1, _step(3))
    shards.after_forward(1)  # copied, never named
    shards.on_filled(FilledBlocks((2,), (9,), (bytes(h1),)))  # named, never copied
    shards.before_forward(3 + MAX_COPY_AGE_MESSAGES, _step())
    shards.after_forward(3 + MAX_COPY_AGE_MESSAGES)
    assert shards.copies_dropped == 2
    assert tiers.blocks_stored == 0
