"""Feeds the router's in-process prefix index from the prefill workers' KV events (single router).

One loop per prefill worker pulls `read_kv_events(since_seq)` every `interval_s`, applies the batch
to the index and refreshes the worker's lease. Pulling keeps the workers free of any knowledge of
the router; a worker that stops answering stops being heartbeated, so its entries expire after the
index lease. With Redis configured the workers publish instead and no feeder runs.
"""
from __future__ import annotations

import asyncio
import logging

from cluster.launcher import LaunchedCluster

log = logging.getLogger(__name__)


class IndexFeeder:
    def __init__(self, cluster: LaunchedCluster, index, interval_s: float = 0.05, timeout_s: float = 5.0):
        self.index, self.interval_s, self.timeout_s = index, interval_s, timeout_s
        self._workers = {h.worker_id: h.actor for h in cluster.prefill}
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._follow(worker_id, actor))
                       for worker_id, actor in self._workers.items()]

    async def sync_once(self) -> None:
        """Pulls and applies every worker's pending events now (tests use it to avoid sleeping)."""
        for worker_id, actor in self._workers.items():
            await self._pull(worker_id, actor)

    async def _follow(self, worker_id: str, actor) -> None:
        failing = False
        while True:
            try:
                await self._pull(worker_id, actor)
                failing = False
            except Exception as err:  # keep following: a slow worker may answer next time
                if not failing:
                    log.warning("cannot read KV events of %s: %s", worker_id, type(err).__name__)
                failing = True
            await asyncio.sleep(self.interval_s)

    async def _pull(self, worker_id: str, actor) -> None:
        cursor = await self.index.cursor(worker_id)
        since_seq = cursor[1] if cursor is not None else 0
        batch = await asyncio.wait_for(actor.read_kv_events.remote(since_seq), self.timeout_s)
        if cursor is not None and batch.epoch != cursor[0] and since_seq:
            # A restarted worker: our cursor belongs to its old epoch; read its new epoch from the start.
            batch = await asyncio.wait_for(actor.read_kv_events.remote(0), self.timeout_s)
        if batch.events or batch.snapshot is not None or cursor is None or cursor[0] != batch.epoch:
            await self.index.apply(batch)
        await self.index.heartbeat(worker_id, batch.epoch)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
