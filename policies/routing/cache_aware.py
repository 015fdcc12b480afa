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
            _, tied = self._least_cost(query, workers, {})
            return RouteDecision(self.fallback.first_in_ring(query, workers, tied), 0)
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
        blocks, tied = self._least_cost(query, workers, cached_blocks)
        decision = RouteDecision(self.fallback.first_in_ring(query, workers, tied), blocks)
        # The best holder among these workers (ties: ring order), named so the chosen one can pull from it.
        members = {w.worker_id for w in workers} if matches else set()
        held = {m.worker_id: m.num_blocks for m in matches if m.worker_id in members and m.num_blocks > 0}
        if not held:
            return decision
        most = max(held.values())
        holder_id = self.fallback.first_in_ring(query, workers, {w for w, n in held.items() if n == most})
        return decision._replace(holder_id=holder_id, holder_blocks=most)

    @staticmethod
    def _least_cost(
        query: RouteQuery, workers: Sequence[WorkerLoad], cached_blocks: dict[str, int]
    ) -> tuple[int, set[str]]:
        """(cached blocks, ids) of the workers at the least (cost, -cached blocks): the ring breaks their tie.

        A worker holding nothing costs its queue plus the whole prompt, so among those only the least
        queued count; holders are scored one by one. Only the tied workers are ranked on the ring
        afterwards: a full ring order of a large fleet costs more than scoring it.
        """
        # A hit never covers the whole prompt: the last token is always computed (it yields the first
        # output token), so the uncached count is at least one.
        prompt, size = query.num_prompt_tokens, query.block_size
        least_queued = min(w.queued_prompt_tokens for w in workers)
        best = (least_queued + max(prompt, 1), 0)
        holders = []
        if cached_blocks:
            for w in workers:
                blocks = cached_blocks.get(w.worker_id, 0)
                if blocks:
                    holders.append((w.queued_prompt_tokens + max(prompt - blocks * size, 1), -blocks, w.worker_id))
        if holders:
            best = min(best, min(holders)[:2])
        if best[1]:
            return -best[1], {w for cost, neg_blocks, w in holders if (cost, neg_blocks) == best}
        return 0, {
            w.worker_id for w in workers if w.queued_prompt_tokens == least_queued and w.worker_id not in cached_blocks
        }
