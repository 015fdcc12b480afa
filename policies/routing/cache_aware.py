"""`cache_aware`: one cost per worker combining cached-prefix overlap and live load.

cost(worker) = queued prompt tokens already routed there
             + prompt tokens it would have to compute (the prompt minus the prefix it holds)

Both terms are prefill work in tokens, so they add without a tuning knob, and there is no two-tier
"cache first unless overloaded" switch: a long cached prefix wins until the holder's queue is longer
than the recompute elsewhere. Ties go to the longer cached prefix, then to the prompt's order on the
`prefix_hash` ring — so routers that share an index agree on a cold prefix too, and cold prefixes
spread over the workers instead of piling onto the lowest id.
The prefix comes from a `PrefixIndex` (in-process by default, Redis when configured); if the index
cannot answer, the choice falls back to `prefix_hash` for that request (no client-visible error).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from policies.routing.base import RouteDecision, RouteQuery, RoutingPolicy, WorkerLoad, require_workers
from policies.routing.prefix_hash import PrefixHashPolicy

log = logging.getLogger(__name__)


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, index, fallback: PrefixHashPolicy | None = None):
        self.index = index  # prefix_index.PrefixIndex
        self.fallback = fallback or PrefixHashPolicy()
        self.index_failures = 0
        self._degraded = False

    async def choose(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> RouteDecision:
        require_workers(workers)
        if not query.block_hashes:  # nothing cacheable: the least loaded, ties in ring order
            rank = {worker_id: i for i, worker_id in enumerate(self.fallback.preference(query, workers))}
            return min(self._score(query, w, 0, rank[w.worker_id]) for w in workers)[-1]
        try:
            matches = await self.index.match(query.block_hashes)
        except Exception as err:  # noqa: BLE001 - an unreachable index degrades routing, never the request
            self.index_failures += 1
            if not self._degraded:
                log.warning("prefix index unavailable (%s); routing by prefix_hash until it returns", err)
            self._degraded = True
            return self.fallback.choose_now(query, workers)
        self._degraded = False
        cached_blocks = {m.worker_id: m.num_blocks for m in matches}
        rank = {worker_id: i for i, worker_id in enumerate(self.fallback.preference(query, workers))}
        decision = min(self._score(query, w, cached_blocks.get(w.worker_id, 0), rank[w.worker_id]) for w in workers)[-1]
        # The best holder among these workers (ties: ring order), named so the chosen one can pull from it.
        holder = min(workers, key=lambda w: (-cached_blocks.get(w.worker_id, 0), rank[w.worker_id]))
        if cached_blocks.get(holder.worker_id, 0) == 0:
            return decision
        return decision._replace(holder_id=holder.worker_id, holder_blocks=cached_blocks[holder.worker_id])

    @staticmethod
    def _score(query: RouteQuery, worker: WorkerLoad, blocks: int, ring_rank: int) -> tuple:
        # A hit never covers the whole prompt: the last token is always computed (it yields the first
        # output token), so the uncached count is at least one.
        uncached = max(query.num_prompt_tokens - blocks * query.block_size, 1)
        cost = worker.queued_prompt_tokens + uncached
        return (cost, -blocks, ring_rank, RouteDecision(worker.worker_id, blocks))
