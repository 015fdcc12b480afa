"""Feeds the router's in-process prefix index from the prefill workers' KV events (no Redis).

One loop per prefill member pulls `read_kv_events(since_seq)`, applies the batch to the index and
refreshes the worker's lease. A pull is a long poll: a worker with no new event answers when one comes,
or after `max_wait_s` (the lease's heartbeat), so an idle worker costs one Ray call per `max_wait_s`
instead of one per `interval_s`, which is now the least time between two pulls (events arriving
meanwhile come in one batch). It follows membership: a worker that leaves (dead or
drained) has its loop stopped and its entries dropped at once; its replacement (same worker id, new
epoch) gets a new loop. Dropping a departed worker's entries also lets go of its worker slot in the
index; the slot is reused once the router's prefill book has let go of it too (router/routable_loads.py).
With Redis configured the workers publish instead and no feeder runs.
"""

from __future__ import annotations

import asyncio
import logging

from cluster.cluster_view import ClusterView
from common.membership import Member, Membership

log = logging.getLogger(__name__)


class IndexFeeder:
    def __init__(
        self, view: ClusterView, index, interval_s: float = 0.05, timeout_s: float = 5.0, max_wait_s: float = 1.0
    ):
        self.view, self.index, self.interval_s, self.timeout_s = view, index, interval_s, timeout_s
        self.max_wait_s = max_wait_s
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}  # (worker id, epoch) → its loop
        self._removals: set[asyncio.Task] = set()
        self._started = False
        view.listeners.append(self._on_membership)

    def start(self) -> None:
        self._started = True
        self._on_membership(self.view.membership, self.view.membership)

    async def sync_once(self) -> None:
        """Pulls and applies every worker's pending events now (tests use it to avoid sleeping)."""
        for member in self._prefill():
            await self._pull(member)

    def _prefill(self) -> list[Member]:
        return [m for m in self.view.members if m.role == "prefill"]

    def _on_membership(self, old: Membership, new: Membership) -> None:
        if not self._started:
            return
        live = {(m.worker_id, m.epoch): m for m in self._prefill()}
        for key in [key for key in self._tasks if key not in live]:
            self._tasks.pop(key).cancel()
            if new.get(key[0]) is None:  # gone for good (a restart's new epoch replaces its entries itself)
                removal = asyncio.ensure_future(self.index.remove_worker(key[0]))
                self._removals.add(removal)
                removal.add_done_callback(self._removals.discard)
        for key, member in live.items():
            if key not in self._tasks:
                self._tasks[key] = asyncio.ensure_future(self._follow(member))

    async def _follow(self, member: Member) -> None:
        failing, max_wait_s = False, self.max_wait_s
        while True:
            try:
                await self._pull(member, max_wait_s)
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - keep following: a slow worker may answer next time
                if isinstance(err, TypeError) and max_wait_s:
                    # A worker of an earlier release takes no wait bound (a router upgraded before the Ray
                    # pods): poll it every interval instead.
                    log.info("%s does not long-poll its KV events: polling it", member.worker_id)
                    max_wait_s = 0.0
                    continue
                if not failing:
                    log.warning("cannot read KV events of %s: %s", member.worker_id, type(err).__name__)
                failing = True
            await asyncio.sleep(self.interval_s)

    async def _pull(self, member: Member, max_wait_s: float = 0.0) -> None:
        worker_id, worker = member.worker_id, member.prefill_worker
        cursor = await self.index.cursor(worker_id)
        since_seq = cursor[1] if cursor is not None else 0
        batch = await asyncio.wait_for(worker.read_kv_events(since_seq, max_wait_s), self.timeout_s + max_wait_s)
        if cursor is not None and batch.epoch != cursor[0] and since_seq:
            # A restarted worker: our cursor belongs to its old epoch; read its new epoch from the start.
            batch = await asyncio.wait_for(worker.read_kv_events(0), self.timeout_s)
        if batch.events or batch.snapshot is not None or cursor is None or cursor[0] != batch.epoch:
            await self.index.apply(batch)
        await self.index.heartbeat(worker_id, batch.epoch)

    async def close(self) -> None:
        self._started = False
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
