"""The shared KV store as a routing location: which leading blocks of a prompt it holds, and what a
prefill worker pays to fetch them, in the prefill tokens `cache_aware` counts cost in
(policies/routing/cache_aware.py; docs/architecture.md#kv-tiers).

Held blocks: the store itself is asked (key presence over the prompt's chain, one round trip per 32
blocks, on a thread of its own with `timeout_s`), so the answer follows the store's own LRU eviction
and outlives every worker that wrote the blocks. The keys carry the workers' KV layout digest, which
the router learns from their stats; until a worker reported one, or while the store cannot answer, it
holds nothing. A block a tensor-parallel decode instance stored as head shards (a migrated request's
generated blocks) counts as held when every shard of it is: the same round trip asks for the shard
keys of the layouts the workers report (`StoreReads.shard_layouts`), since they assemble such blocks.

Price: fetch_tokens(n) = fetch_s(n blocks' bytes) / per_token_s, with fetch_s fitted (latency + bytes /
bandwidth) from what the prefill workers measured on their own fetches (`StoreReads`: read, checked
and loaded into the pool) and per_token_s the prefill cost model's fitted per-token time (the pull
planner's, fed by the workers' engine steps). Until fetches were seen it uses STORE_READ_PRIOR.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from common.kv_store_config import KVStoreConfig
from common.messages import StoreReads
from engine.block_hash import BlockHash
from kv_store.base import BlockStore
from kv_store.block_record import block_key
from kv_store.redis_store import RedisBlockStore
from kv_store.tiers import held_run
from policies.admission import PrefillCostModel
from policies.admission.cost_model import TransferCostModel, TransferTimeFit
from policies.admission.step_stats import TransferStep

# A cold router's guess, on the scale of the admission priors (a GPU worker reading Redis over a
# datacenter network): 5 ms of round trips and engine hops, then 0.5 GB/s. The fit replaces it after 8
# reported intervals; docs/performance.md has what CPU workers measure (far less).
STORE_READ_PRIOR = TransferTimeFit(latency_s=0.005, per_byte_s=2e-9)
MIN_PER_TOKEN_S = 1e-9  # a fit that says tokens are free would price every fetch out


class StoreFetchCost:
    """`cache_aware`'s `StoreLocation` for a router. Used from the router's event loop only."""

    def __init__(
        self,
        store: BlockStore,
        block_bytes: int,
        prefill_cost: PrefillCostModel,
        timeout_s: float,
        read_prior: TransferTimeFit = STORE_READ_PRIOR,
    ):
        """`store`: the shared tier the workers write (read for key presence only)."""
        self.store, self.block_bytes, self.prefill_cost = store, block_bytes, prefill_cost
        self.timeout_s = timeout_s
        self.read_cost = TransferCostModel(prior=read_prior)
        self.layout: bytes | None = None
        self.shard_layouts: tuple[bytes, ...] = ()  # a TP decode instance's head ranges, in head order
        self._seen: dict[tuple[str, int], StoreReads] = {}  # (worker, epoch) → its last report
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store-probe")

    @classmethod
    def from_config(
        cls, config: KVStoreConfig, block_bytes: int, prefill_cost: PrefillCostModel
    ) -> StoreFetchCost | None:
        """The store location of `config`, None when no shared store is configured."""
        if config.url is None:
            return None
        store = RedisBlockStore(config.url, timeout_s=config.timeout_s, retry_after_s=config.retry_after_s)
        return cls(store, block_bytes, prefill_cost, config.timeout_s)

    async def held_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        layout = self.layout
        if layout is None or not block_hashes:
            return 0
        keys = [block_key(layout, h) for h in block_hashes]
        shard_keys = [[block_key(shard, h) for shard in self.shard_layouts] for h in block_hashes]
        held = functools.partial(held_run, self.store, keys, shard_keys if self.shard_layouts else ())
        return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._pool, held), self.timeout_s)

    def fetch_tokens(self, num_blocks: int) -> int:
        if num_blocks <= 0:
            return 0
        fetch_s = self.read_cost.fit().time_s(num_blocks * self.block_bytes)
        return math.ceil(fetch_s / max(self.prefill_cost.fit().per_token_s, MIN_PER_TOKEN_S))

    def observe_stats(self, worker_id: str, role: str, epoch: int, stats) -> None:
        """WorkerMonitor listener: a prefill worker's fetches since its last report feed the read model."""
        reads: StoreReads | None = getattr(stats, "store_reads", None)
        if role != "prefill" or reads is None:
            return
        self.layout = bytes.fromhex(reads.layout)
        self.shard_layouts = tuple(bytes.fromhex(layout) for layout in reads.shard_layouts)
        last = self._seen.get((worker_id, epoch))
        self._seen[(worker_id, epoch)] = reads
        if last is None:
            last = StoreReads(reads.layout, 0, 0.0)
        moved_bytes, took_s = reads.fetched_bytes - last.fetched_bytes, reads.fetch_s - last.fetch_s
        if moved_bytes > 0 and took_s > 0:
            self.read_cost.observe(TransferStep(moved_bytes, took_s))

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """The fitted fetch bandwidth (what `splitserve status` and the docs call the measured one)."""
        return self.read_cost.fit().bandwidth_bytes_per_s

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()
