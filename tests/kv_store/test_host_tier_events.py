"""What enters and leaves a host tier is reported as it happens (`on_change`, under the tier's lock),
as the net change of each write; a worker's event buffer numbers those host-tier events with its pool's
and a snapshot for a reader that fell behind lists both."""

from __future__ import annotations

import pytest
import torch

from common.kv_events import KVEventBuffer
from common.kv_store_config import KVStoreConfig
from engine.block_hash import HashNamespace, hash_blocks
from engine.block_pool import MEDIUM_HOST, BlockRemoved, BlockStored
from engine.kv_cache_manager import KVCacheManager
from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from kv_store.block_record import block_key, hash_of_key
from kv_store.host_tier import DiskTier, MemoryTier
from kv_store.worker_tiers import WorkerKVTiers

BLOCK = 4


@pytest.fixture(params=["memory", "disk"])
def tier(request, tmp_path):
    made = MemoryTier(3 * 10) if request.param == "memory" else DiskTier(tmp_path, 3 * 10, 10)
    yield made
    made.close()


def test_a_host_tier_reports_stores_and_evictions_as_net_changes(tier):
    changes: list[tuple[list[bytes], list[bytes]]] = []
    tier.on_change = lambda stored, evicted: changes.append((stored, evicted))
    tier.put_many([(b"a", b"x" * 10), (b"b", b"x" * 10), (b"c", b"x" * 10)])
    assert changes == [([b"a", b"b", b"c"], [])]
    tier.get_many([b"a"])  # a is now the most recently used: b goes first
    tier.put_many([(b"d", b"x" * 10), (b"b", b"x" * 10)])  # d evicts b, then b evicts c
    assert changes[1] == ([b"d", b"b"], [b"c"])  # b was evicted and stored again by one call: held
    assert tier.contains_many([b"a", b"b", b"c", b"d"]) == [True, True, False, True]
    tier.put_many([(b"e", b"x" * 10), (b"e", b"y" * 10)])
    assert changes[2] == ([b"e"], [b"a"])
    tier.put_many([])
    assert len(changes) == 3  # nothing changed: no call


def test_host_events_share_the_pool_events_numbering_and_snapshots_list_both_media():
    hashes = hash_blocks(HashNamespace("model/events", 4), list(range(16)))
    assert hash_of_key(block_key(bytes(16), hashes[2])) == hashes[2]
    buffer = KVEventBuffer("w", capacity=2, epoch=7)
    buffer.append(BlockStored(tuple(hashes[:2]), None, ()))
    buffer.append(BlockStored(tuple(hashes), None, (), medium=MEDIUM_HOST))
    buffer.append(BlockRemoved((hashes[3],), medium=MEDIUM_HOST))
    buffer.append(BlockRemoved((hashes[1],)))
    batch = buffer.read_since(2)
    assert [(seq, event.medium) for seq, event in batch.events] == [(3, MEDIUM_HOST), (4, "pool")]
    snapshot = buffer.read_since(0)  # events 1 and 2 were dropped: a snapshot of both media
    assert snapshot.events == () and snapshot.last_seq == 4
    assert snapshot.snapshot == (hashes[0],)
    assert snapshot.host_snapshot == (hashes[0], hashes[1], hashes[2])


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_workers_tiers_publish_their_host_tier_and_count_the_fetches_it_served(tmp_path, kind):
    storage = KVCacheStorage(kv_format("int8", torch.float32), 2, 2, 8, BLOCK, 8)
    box: list[WorkerKVTiers] = []
    kv = KVCacheManager(8, BLOCK, on_event=lambda event: box[0].on_kv_event(event))
    config = KVStoreConfig(host_tier_bytes=1 << 20, host_tier=kind, host_tier_dir=str(tmp_path))
    tiers = WorkerKVTiers(config, storage, kv)
    box.append(tiers)
    buffer = KVEventBuffer("w", epoch=1)
    tiers.publish_host_events(buffer.append)  # the prefill worker's wiring
    tokens = list(range(3 * BLOCK + 1))
    hashes = hash_blocks(HashNamespace("m", BLOCK, ""), tokens[: 3 * BLOCK])
    kv.allocate("s", len(tokens))
    kv.cache_blocks("s", tokens, hashes, 3 * BLOCK)
    assert tiers.writer.flush(10.0)
    batch = buffer.read_since(0)  # published from the writer thread, numbered by the buffer
    assert {e.medium for _, e in batch.events} == {MEDIUM_HOST}
    assert [h for _, e in batch.events for h in e.block_hashes] == hashes

    assert len(tiers.fetch(hashes)) == 3  # served by the host tier alone: counted as a host-tier fetch
    tiers.count_fetch(3, 0.25)
    reads = tiers.reads()
    assert (reads.fetched_bytes, reads.host_fetched_bytes) == (3 * tiers.codec.payload_bytes,) * 2
    assert reads.host_fetch_s == reads.fetch_s == 0.25
    tiers.close()
