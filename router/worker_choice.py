"""Which serving workers a request goes to: a prefill worker by the routing policy, a decode instance
by the fewest streams this router has on it; while a pool has no serving worker (a dead worker's
replacement is starting), wait for membership to bring one.

Only workers the monitor holds healthy are candidates; the prefill loads the policy weighs are this
router's own exact counts (`RouteLedger`).
"""

from __future__ import annotations

import time

from cluster.client import ClusterClient
from cluster.cluster_view import ClusterView
from policies.routing import NoWorkersError, RouteQuery, RoutingPolicy
from router.ledger import RouteLedger
from router.worker_monitor import WorkerMonitor


class WorkerChooser:
    def __init__(
        self,
        cluster: ClusterView,
        policy: RoutingPolicy,
        monitor: WorkerMonitor,
        ledger: RouteLedger,
        client: ClusterClient,
    ):
        self.cluster, self.policy, self.monitor, self.ledger, self.client = cluster, policy, monitor, ledger, client

    async def choose(self, query: RouteQuery, deadline_s: float | None):
        """A serving prefill worker and decode instance for the query; waits for membership (a dead worker's
        replacement) while a pool has none, up to the request's deadline or `router.worker_wait_s`."""
        wait_until_s = time.monotonic() + self.cluster.config.router.worker_wait_s
        if deadline_s is not None:
            wait_until_s = min(wait_until_s, deadline_s)
        while True:
            missing = self._missing_pool()
            if missing is None:
                return await self._pick(query)
            if time.monotonic() >= wait_until_s:
                raise NoWorkersError(f"no healthy {missing} to route to")
            await self.cluster.wait_for_change(min(wait_until_s - time.monotonic(), 1.0))

    def _missing_pool(self) -> str | None:
        if not any(self.monitor.is_healthy(m.worker_id) for m in self.cluster.prefill):
            return "prefill worker"
        if not any(self.monitor.is_healthy(m.worker_id) for m in self.cluster.decode):
            return "decode instance"
        return None

    async def _pick(self, query: RouteQuery):
        healthy = [h for h in self.cluster.prefill if self.monitor.is_healthy(h.worker_id)]
        loads = [self.ledger.prefill_load(h.worker_id) for h in healthy]
        decision = await self.policy.choose(query, loads)
        prefill = next(h for h in healthy if h.worker_id == decision.worker_id)
        decodes = [d for d in self.cluster.decode if self.monitor.is_healthy(d.worker_id)]
        decode = min(decodes, key=lambda d: (self.client.decode_load(d.worker_id), d.worker_id))
        return prefill, decode, decision
