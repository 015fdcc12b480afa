"""Periodic health and load probes of every worker, for routing and `GetClusterStatus`.

Each probe is a `stats()` call bounded by `timeout_s`. A worker whose probe fails or times out is
unhealthy (no new requests are routed to it) until a later probe succeeds. Requests already on a
dead worker fail on their own (the cluster client sees the actor die); this only steers new ones.
"""
from __future__ import annotations

import asyncio
import logging

from cluster.launcher import LaunchedCluster

log = logging.getLogger(__name__)


class WorkerMonitor:
    def __init__(self, cluster: LaunchedCluster, metrics=None, interval_s: float = 1.0, timeout_s: float = 5.0):
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.metrics = metrics  # router.metrics.RouterMetrics: per-worker gauges, when given
        self._roles = {h.worker_id: "prefill" for h in cluster.prefill}
        self._roles.update({d.instance_id: "decode" for d in cluster.decode})
        self._actors = {h.worker_id: h.actor for h in cluster.prefill}
        self._actors.update({d.instance_id: d.driver for d in cluster.decode})
        self.stats: dict[str, dict] = {worker_id: {} for worker_id in self._actors}
        self._unhealthy: set[str] = set()
        self.listeners: list = []  # called with (worker_id, stats) after each successful probe
        self._task: asyncio.Task | None = None
        self._probes: set[asyncio.Task] = set()

    def is_healthy(self, worker_id: str) -> bool:
        return worker_id not in self._unhealthy

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())

    def probe_soon(self) -> None:
        """Schedules a probe of every worker now (after a request saw a worker fail)."""
        task = asyncio.ensure_future(self.probe_all())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(worker_id, actor) for worker_id, actor in self._actors.items()))

    async def _loop(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def _probe(self, worker_id: str, actor) -> None:
        try:
            self.stats[worker_id] = await asyncio.wait_for(actor.stats.remote(), self.timeout_s)
        except Exception as err:  # dead, hung or crashed: all mean "route elsewhere"
            if worker_id not in self._unhealthy:
                log.warning("worker %s is unhealthy: %s", worker_id, type(err).__name__)
            self._unhealthy.add(worker_id)
        else:
            for listener in self.listeners:
                listener(worker_id, self.stats[worker_id])
            if worker_id in self._unhealthy:
                log.info("worker %s is healthy again", worker_id)
            self._unhealthy.discard(worker_id)
        self._export(worker_id)

    def _export(self, worker_id: str) -> None:
        if self.metrics is not None:
            stats = self.stats.get(worker_id, {})
            self.metrics.set_worker_load(worker_id, self._roles[worker_id], stats.get("waiting", 0),
                                         stats.get("running", 0), stats.get("kv_usage", 0.0),
                                         healthy=self.is_healthy(worker_id))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
