"""Which serving workers a request goes to: a prefill worker by the routing policy, a decode instance
by the fewest streams this router has on it; while a pool has no serving worker (a dead worker's
replacement is starting), wait for membership to bring one.

Only workers the monitor holds healthy are candidates; the prefill loads the policy weighs are this
router's own exact counts (`RouteLedger`). Both pools come from `RoutableLoads`, kept in load order as
loads and membership change, so a decision costs the same at 10 workers as at 10,000.
"""

from __future__ import annotations

import time

from cluster.client import ClusterClient
from cluster.cluster_view import ClusterView
from policies.routing import NoWorkersError, RouteQuery, RoutingPolicy
from router.ledger import RouteLedger
from router.routable_loads import RoutableLoads
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
        # With an in-process index the prefill book shares its worker slots: the policy walks with masks.
        self.loads = RoutableLoads(cluster, monitor, ledger, client, policy.holder_slots())

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
        if not self.loads.prefill:
            return "prefill worker"
        if not self.loads.decode:
            return "decode instance"
        return None

    async def _pick(self, query: RouteQuery):
        decision = await self.policy.choose(query, self.loads.prefill)
        # The policy decides synchronously after its index lookup, so its choice is in the book now.
        prefill = self.loads.member(decision.worker_id)
        assert prefill is not None, f"the policy chose {decision.worker_id}, which is not a member"
        if not self.loads.decode:  # the lookup's await let membership take the last decode instance
            raise NoWorkersError("no healthy decode instance to route to")
        return prefill, self.loads.least_loaded_decode(), decision
