"""`least_loaded`: the worker with the least prefill work queued, ignoring the cache (a baseline).

Fewest uncached prompt tokens queued there, then fewest requests in flight, then the smallest id
(`base.least_loaded`): `cache_aware`'s load term without its cache term, so the two compared on one
workload show what prefix affinity alone is worth.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import RouteDecision, RouteQuery, RoutingPolicy, WorkerLoad, least_loaded, require_workers
from policies.routing.load_book import LoadBook


class LeastLoadedPolicy(RoutingPolicy):
    name = "least_loaded"

    async def choose(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> RouteDecision:
        require_workers(workers)
        # A LoadBook keeps its workers in load order: its least is read, not searched for.
        least = workers.least() if isinstance(workers, LoadBook) else least_loaded(workers)
        return RouteDecision(least.worker_id, 0)
