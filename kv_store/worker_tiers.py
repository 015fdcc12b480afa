"""One worker's KV tiers, bound to its engine's KV storage: what the prefill and decode workers call.

Engine thread: `on_blocks_stored` (the pool's BlockStored events) copies each newly cached block out
of the pool and queues it for the writer, which makes the record (header, checksum); `load` writes
fetched records into reserved pool blocks.
Any thread (the worker's store thread): `fetch` reads a chain of block hashes from the tiers, records
checked against their hash, layout and checksum (a refused record counts as corrupt and ends the
run: the block is computed instead); where whole records end, blocks a tensor-parallel decode instance
stored as head shards are read and joined (kv_store/block_shards.py). A rank of such an instance
writes its shards through `store_snapshots` (decode_worker/shard_store.py).
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Sequence

from common.kv_store_config import KVStoreConfig
from common.messages import KVTierStatus, StoreReads
from engine.block_hash import BlockHash
from engine.block_pool import MEDIUM_HOST, BlockRemoved, BlockStored, KVCacheEvent
from engine.kv_cache_manager import KVCacheManager
from engine.kv_storage import KVCacheStorage
from kv_store.base import BlockStore
from kv_store.block_record import BlockCodec, HeadRange, hash_of_key
from kv_store.block_shards import ShardAssembler, head_ranges
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
    def __init__(
        self,
        config: KVStoreConfig,
        storage: KVCacheStorage,
        kv: KVCacheManager | None,
        only_missing: bool = False,
        *,
        heads: HeadRange | None = None,
        decode_tp_size: int = 1,
    ):
        """`only_missing`: write only blocks the tiers lack (a decode instance, whose prompt blocks came
        from a prefill worker that stored them already). `heads`: the range of the model's KV heads
        `storage` holds (a rank of a TP decode instance: it writes shard records; `kv` None on ranks
        without a block pool). `decode_tp_size`: `fetch` also assembles blocks from the shard records of
        decode instances of this many ranks (kv_store/block_shards.py)."""
        self.only_missing = only_missing
        self.codec = BlockCodec(storage, heads)
        self.kv = kv
        ranges = head_ranges(storage.num_kv_heads, decode_tp_size) if heads is None else []
        self.shards = ShardAssembler(self.codec, ranges) if len(ranges) > 1 else None
        self.tiers = build_tiers(config, self.codec.record_bytes, storage.values.device.type == "cuda")
        self.reader = TieredStore(self.tiers)
        self.writer = StoreWriter(self.tiers, config.max_queued_writes)
        self._loading = False  # engine thread: registering fetched blocks, which the tiers already hold
        self.blocks_stored = 0  # queued for writing
        self.blocks_fetched = 0  # loaded into the pool from a tier
        self.records_refused = 0  # found but corrupt or foreign: computed instead
        self.blocks_assembled = 0  # read whole from a TP decode instance's shard records
        self.fetched_bytes = 0  # payload bytes of the fetches that loaded blocks (the store fetcher's count)
        self.fetch_s = 0.0  # and the time they took, end to end
        self.host_fetched_bytes = 0  # the same for fetches served wholly by the host tier
        self.host_fetch_s = 0.0
        self._last_fetch_from_host = False  # the store thread's last `fetch` read only the host tier

    # ---- engine thread --------------------------------------------------------------------------
    def on_kv_event(self, event: KVCacheEvent, keep: Callable[[int], bool] | None = None) -> None:
        """Queues the blocks a BlockStored event registered (their KV is final by then); `keep(block_id)`
        may pass over some (a TP rank stores only blocks its last step filled)."""
        if self._loading or not isinstance(event, BlockStored) or self.kv is None:
            return
        snapshots = []
        for block_hash in event.block_hashes:
            block_id = self.kv.cached_block(block_hash)
            if block_id is not None and (keep is None or keep(block_id)):  # copied now: it may be reused
                snapshots.append((block_hash, self.codec.snapshot(block_id)))
        self.store_snapshots(snapshots)

    def store_snapshots(self, snapshots: Sequence[tuple[BlockHash, list[bytes]]]) -> None:
        """Queues blocks already copied out of the pool (`codec.snapshot`); the writer thread seals them."""
        items: list[tuple[bytes, RecordSource]] = [
            (self.codec.key(block_hash), functools.partial(self.codec.seal, block_hash, parts))
            for block_hash, parts in snapshots
        ]
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
        host_hits_before = self._host_hits()

        def accept(index: int, record: bytes) -> bool:
            ok = self.codec.check(record, block_hashes[index])
            self.records_refused += 0 if ok else 1
            return ok

        run = self.reader.fetch_chain([self.codec.key(h) for h in block_hashes], accept)
        # a migrated request: whole prompt blocks (a prefill worker's), then its decode instance's shards
        while self.shards is not None and len(run) < len(block_hashes):
            assembled = self._fetch_shards(block_hashes[len(run) :])
            run += assembled
            if not assembled or len(run) == len(block_hashes):
                break
            whole = self.reader.fetch_chain([self.codec.key(h) for h in block_hashes[len(run) :]], accept)
            if not whole:
                break
            run += whole
        # Fetches run on one thread, so the host tier's hit count moved by this fetch's reads only.
        self._last_fetch_from_host = bool(run) and self._host_hits() - host_hits_before >= len(run)
        return run

    def _host_hits(self) -> int:
        """The host tier's hits so far (0 without one: no fetch then counts as served by it)."""
        host = self.tiers[0] if self.tiers else None
        return host.stats.hits if isinstance(host, (MemoryTier, DiskTier)) else 0

    def _fetch_shards(self, block_hashes: Sequence[BlockHash]) -> list[bytes]:
        """Whole records of the longest leading run of `block_hashes` whose every shard is held and sound."""
        shards = self.shards
        assert shards is not None
        width = shards.width

        def accept(index: int, record: bytes) -> bool:
            ok = shards.check(index % width, record, block_hashes[index // width])
            self.records_refused += 0 if ok else 1
            return ok

        found = self.reader.fetch_chain([key for h in block_hashes for key in shards.keys(h)], accept)
        blocks = [
            shards.assemble(block_hashes[i], found[i * width : (i + 1) * width]) for i in range(len(found) // width)
        ]
        self.blocks_assembled += len(blocks)
        return blocks

    def publish_host_events(self, append: Callable[[KVCacheEvent], None]) -> None:
        """Reports what enters and leaves the host tier as KV events of medium "host" to `append` (the
        worker's event buffer), from the tier's writing thread: the prefix index then knows a block the
        pool evicted is still a fetch away on this worker. No-op without a host tier."""
        host = self.tiers[0] if self.tiers else None
        if not isinstance(host, (MemoryTier, DiskTier)):
            return

        own = self.codec.key(BlockHash(b""))  # whole blocks of this worker's layout (not other ranks' shards)

        def on_change(stored_keys: list[bytes], evicted_keys: list[bytes]) -> None:
            stored = tuple(hash_of_key(k) for k in stored_keys if k.startswith(own))
            evicted = tuple(hash_of_key(k) for k in evicted_keys if k.startswith(own))
            if stored:
                append(BlockStored(stored, None, (), medium=MEDIUM_HOST))
            if evicted:
                append(BlockRemoved(evicted, medium=MEDIUM_HOST))

        host.on_change = on_change

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: hits, misses, bytes, errors, evictions, used and capacity bytes."""
        out = {tier.name: tier.stats.snapshot() for tier in self.tiers}
        out["worker"] = {
            "blocks_stored": self.blocks_stored,
            "blocks_fetched": self.blocks_fetched,
            "records_refused": self.records_refused,
            "blocks_assembled": self.blocks_assembled,
            "writes_dropped": self.writer.dropped_batches,
        }
        return out

    def count_fetch(self, num_blocks: int, duration_s: float) -> None:
        """A fetch that loaded `num_blocks` blocks in `duration_s` (what the router prices fetches by)."""
        self.fetched_bytes += num_blocks * self.codec.payload_bytes
        self.fetch_s += duration_s
        if self._last_fetch_from_host:
            self.host_fetched_bytes += num_blocks * self.codec.payload_bytes
            self.host_fetch_s += duration_s

    def reads(self) -> StoreReads:
        return StoreReads(
            self.codec.layout.hex(),
            self.fetched_bytes,
            self.fetch_s,
            self.host_fetched_bytes,
            self.host_fetch_s,
            tuple(layout.hex() for layout in self.shards.layouts) if self.shards is not None else (),
        )

    def status(self) -> tuple[KVTierStatus, ...]:
        """Per tier, upper first: sizes and hits (what `splitserve status` shows)."""
        return tuple(
            KVTierStatus(t.name, t.stats.used_bytes, t.stats.capacity_bytes, t.stats.hits, t.stats.misses)
            for t in self.tiers
        )

    def close(self, timeout_s: float = 5.0) -> None:
        self.writer.close(timeout_s)
        self.reader.close()
