"""`round_robin`: each worker in turn, ignoring cache and load (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from policies.routing.base import RouteDecision, RouteQuery, RoutingPolicy, WorkerLoad, require_workers


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self):
        self._next = 0

    async def choose(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> RouteDecision:
        require_workers(workers)
        ordered = sorted(w.worker_id for w in workers)  # stable order whatever the caller passes
        worker_id = ordered[self._next % len(ordered)]
        self._next += 1
        return RouteDecision(worker_id, 0)
