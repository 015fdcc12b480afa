"""One worker's KV tiers, bound to its engine's KV storage: what the prefill and decode workers call.

Engine thread: `on_blocks_stored` (the pool's BlockStored events) copies each newly cached block out
of the pool and queues it for the writer, which makes the record (header, checksum); `load` writes
fetched records into reserved pool blocks.
Any thread (the worker's store thread): `fetch` reads a chain of block hashes from the tiers, records
checked against their hash, layout and checksum (a refused record counts as corrupt and ends the
run: the block is computed instead).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Sequence

from common.kv_store_config import KVStoreConfig
from common.messages import KVTierStatus, StoreReads
from engine.block_hash import BlockHash
from engine.block_pool import BlockStored, KVCacheEvent
from engine.kv_cache_manager import KVCacheManager
from engine.kv_storage import KVCacheStorage
from kv_store.base import BlockStore
from kv_store.block_record import BlockCodec
from kv_store.host_tier import DiskTier, MemoryTier
from kv_store.redis_store import RedisBlockStore
from kv_store.tiers import RecordSource, StoreWriter, TieredStore


def build_tiers(config: KVStoreConfig, record_bytes: int, on_gpu: bool) -> list[BlockStore]:
    """The tiers `config` asks for, upper first: host (memory or disk), then the shared store."""
    tiers: list[BlockStore] = []
    if config.host_tier_bytes > 0:
        kind = config.host_tier if config.host_tier != "auto" else ("memory" if on_gpu else "disk")
        if kind == "memory":
            tiers.append(MemoryTier(config.host_tier_bytes))
        else:
            directory = config.host_tier_dir or os.path.join(tempfile.gettempdir(), "splitserve-kv")
            tiers.append(DiskTier(directory, config.host_tier_bytes, record_bytes))
    if config.url is not None:
        tiers.append(RedisBlockStore(config.url, timeout_s=config.timeout_s, retry_after_s=config.retry_after_s))
    return tiers


class WorkerKVTiers:
    def __init__(self, config: KVStoreConfig, storage: KVCacheStorage, kv: KVCacheManager, only_missing: bool = False):
        """`only_missing`: write only blocks the tiers lack (a decode instance, whose prompt blocks came
        from a prefill worker that stored them already)."""
        self.only_missing = only_missing
        self.codec = BlockCodec(storage)
        self.kv = kv
        self.tiers = build_tiers(config, self.codec.record_bytes, storage.values.device.type == "cuda")
        self.reader = TieredStore(self.tiers)
        self.writer = StoreWriter(self.tiers, config.max_queued_writes)
        self._loading = False  # engine thread: registering fetched blocks, which the tiers already hold
        self.blocks_stored = 0  # queued for writing
        self.blocks_fetched = 0  # loaded into the pool from a tier
        self.records_refused = 0  # found but corrupt or foreign: computed instead
        self.fetched_bytes = 0  # payload bytes of the fetches that loaded blocks (the store fetcher's count)
        self.fetch_s = 0.0  # and the time they took, end to end

    # ---- engine thread --------------------------------------------------------------------------
    def on_kv_event(self, event: KVCacheEvent) -> None:
        """Queues the blocks a BlockStored event registered (their KV is final by then)."""
        if self._loading or not isinstance(event, BlockStored):
            return
        items: list[tuple[bytes, RecordSource]] = []
        for block_hash in event.block_hashes:
            block_id = self.kv.cached_block(block_hash)
            if block_id is not None:  # copied now (the block may be reused); sealed on the writer thread
                parts = self.codec.snapshot(block_id)
                items.append((self.codec.key(block_hash), functools.partial(self.codec.seal, block_hash, parts)))
        self.blocks_stored += len(items)
        self.writer.submit(items, self.only_missing)

    def load(self, block_ids: Sequence[int], records: Sequence[bytes], register: Callable[[], object]) -> None:
        """Writes fetched records into reserved blocks, then `register()`s them as cached; the BlockStored
        events that raises are not written back to the tiers the records came from."""
        self.codec.decode_into(block_ids, records)
        self.blocks_fetched += len(records)
        self._loading = True
        try:
            register()
        finally:
            self._loading = False

    # ---- any thread -----------------------------------------------------------------------------
    def fetch(self, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """Records of the longest leading run of `block_hashes` the tiers hold, each checked."""

        def accept(index: int, record: bytes) -> bool:
            ok = self.codec.check(record, block_hashes[index])
            self.records_refused += 0 if ok else 1
            return ok

        return self.reader.fetch_chain([self.codec.key(h) for h in block_hashes], accept)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: hits, misses, bytes, errors, evictions, used and capacity bytes."""
        out = {tier.name: tier.stats.snapshot() for tier in self.tiers}
        out["worker"] = {
            "blocks_stored": self.blocks_stored,
            "blocks_fetched": self.blocks_fetched,
            "records_refused": self.records_refused,
            "writes_dropped": self.writer.dropped_batches,
        }
        return out

    def count_fetch(self, num_blocks: int, duration_s: float) -> None:
        """A fetch that loaded `num_blocks` blocks in `duration_s` (what the router prices fetches by)."""
        self.fetched_bytes += num_blocks * self.codec.payload_bytes
        self.fetch_s += duration_s

    def reads(self) -> StoreReads:
        return StoreReads(self.codec.layout.hex(), self.fetched_bytes, self.fetch_s)

    def status(self) -> tuple[KVTierStatus, ...]:
        """Per tier, upper first: sizes and hits (what `splitserve status` shows)."""
        return tuple(
            KVTierStatus(t.name, t.stats.used_bytes, t.stats.capacity_bytes, t.stats.hits, t.stats.misses)
            for t in self.tiers
        )

    def close(self, timeout_s: float = 5.0) -> None:
        self.writer.close(timeout_s)
        self.reader.close()
