"""Fetching a prompt's missing prefix blocks from the KV tiers (host tier, shared store) before it is
computed: how a worker reuses KV that another worker, a dead decode instance or an earlier start of
itself computed.

One fetch, every step bounded by the store's own timeouts:
1. Engine thread: hash the prompt's full blocks (the last token is always computed, as for a prefix
   hit) and count the leading ones cached locally.
2. Store thread: read the chain after them from the tiers, up to its first gap; each record checked
   against its hash, the KV layout and its checksum (`kv_store/worker_tiers.py`).
3. Engine thread: reserve blocks for what was found (`reserve_pull`, the same reservation a peer pull
   makes), write the records into them and register them in the prefix cache (`commit_pull`); the
   table stays pinned until the request's first token, exactly like a pulled prefix.
A fetch that finds nothing, or no room, changes nothing: the prompt is computed as usual.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from common.messages import GenerateRequest
from engine.block_hash import HashNamespace, hash_blocks
from engine.llm_engine import LLMEngine
from kv_store.worker_tiers import WorkerKVTiers
from prefill_worker.prefix_pull import commit_pull, pull_table_id, reserve_pull


class StoreFetcher:
    """`call_engine(fn)` runs fn(engine) on the engine thread and returns a concurrent Future."""

    def __init__(self, tiers: WorkerKVTiers, call_engine: Callable, metrics):
        self.tiers, self.metrics = tiers, metrics
        self._call_engine = call_engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store-read")

    async def fetch(self, request: GenerateRequest) -> int:
        """Loads the blocks of `request`'s tokens that the tiers hold and this worker does not; returns
        how many it loaded (0 when none)."""
        started_s = time.perf_counter()
        rid, tokens, tenant = request.request_id, request.token_ids, request.tenant
        local, hashes = await self._engine(lambda engine: _local_prefix(engine, tokens, tenant))
        if local >= len(hashes):
            return 0
        loop = asyncio.get_running_loop()
        records = await loop.run_in_executor(self._pool, self.tiers.fetch, hashes[local:])
        if not records:
            return 0

        def load(engine: LLMEngine) -> int:
            wanted = local + len(records)
            reservation = reserve_pull(engine, rid, tokens, tenant, wanted)
            if reservation is None:
                return 0
            skip = reservation.num_local_blocks - local  # blocks cached locally since step 1
            if skip < 0:  # some of the local prefix was evicted meanwhile: the run has a gap
                engine.release(pull_table_id(rid))
                return 0
            self.tiers.load(
                reservation.block_ids, records[skip:], lambda: commit_pull(engine, rid, tokens, tenant, wanted)
            )
            return len(records) - skip

        loaded = await self._engine(load)
        if loaded:
            duration_s = time.perf_counter() - started_s
            self.metrics.observe_transfer("store_in", loaded * self.tiers.codec.payload_bytes, duration_s)
            self.tiers.count_fetch(loaded, duration_s)
        return loaded

    async def _engine(self, fn):
        return await asyncio.wrap_future(self._call_engine(fn))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.tiers.close()


def _local_prefix(engine: LLMEngine, token_ids, tenant: str):
    """(leading blocks cached here, hashes of every block a prefix hit could cover)."""
    size = engine.config.block_size
    num_blocks = (len(token_ids) - 1) // size  # the last token is always computed
    namespace = HashNamespace(engine.model_config.identity, size, tenant)
    hashes = hash_blocks(namespace, token_ids[: num_blocks * size])
    local = engine.kv.find_cached_prefix(token_ids, hashes)
    return len(local.block_ids), hashes
