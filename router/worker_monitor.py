"""Periodic load probes of every member of the cluster, for routing, admission and `GetClusterStatus`.

Liveness is the controller's business, not this monitor's: a worker is routable while membership
lists it as serving. Each probe is a `stats()` call (answered from the worker's last engine snapshot,
so a busy worker answers fast) bounded by `timeout_s`; a probe that times out keeps the last figures.
A worker whose actor is found dead here (by a probe, or by a request: `probe_soon`) is avoided at
once, until membership catches up (within one watch round trip).
"""

from __future__ import annotations

import asyncio
import logging

from ray.exceptions import RayActorError

from cluster.cluster_view import ClusterView
from common.membership import Member, Membership
from common.messages import WorkerStats

log = logging.getLogger(__name__)


class WorkerMonitor:
    def __init__(self, view: ClusterView, metrics=None, interval_s: float = 1.0, timeout_s: float = 5.0):
        self.view, self.interval_s, self.timeout_s = view, interval_s, timeout_s
        self.metrics = metrics  # router.metrics.RouterMetrics: per-worker gauges, when given
        self.stats: dict[str, WorkerStats] = {}
        self._dead: set[tuple[str, int]] = set()  # (worker id, epoch) found dead, until membership drops it
        self.listeners: list = []  # called with (worker_id, role, epoch, stats) after each successful probe
        self.dead_listeners: list = []  # called with (worker_id, epoch) when a start of a worker is found dead
        self._task: asyncio.Task | None = None
        self._probes: set[asyncio.Task] = set()
        view.listeners.append(self._on_membership)

    def is_healthy(self, worker_id: str) -> bool:
        member = self.view.membership.get(worker_id)
        return member is not None and (worker_id, member.epoch) not in self._dead

    def found_dead(self, worker_id: str, epoch: int) -> bool:
        """Whether this start of the worker was found dead (it stays unroutable until membership drops it)."""
        return (worker_id, epoch) in self._dead

    def mark_dead(self, worker_id: str, epoch: int) -> None:
        """A request found this start of the worker dead: avoid it until membership drops it."""
        member = self.view.membership.get(worker_id)
        if member is not None and member.epoch == epoch:
            self._found_dead(worker_id, epoch)

    def _found_dead(self, worker_id: str, epoch: int) -> None:
        if (worker_id, epoch) in self._dead:
            return
        self._dead.add((worker_id, epoch))
        for listener in self.dead_listeners:
            listener(worker_id, epoch)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())

    def probe_soon(self) -> None:
        """Schedules a probe of every worker now (after a request saw a worker fail)."""
        task = asyncio.ensure_future(self.probe_all())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(member) for member in self.view.members))

    async def _loop(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def _probe(self, member: Member) -> None:
        try:
            stats = await asyncio.wait_for(member.prefill_worker.stats(), self.timeout_s)
        except RayActorError as err:
            if (member.worker_id, member.epoch) not in self._dead:
                log.warning("worker %s (epoch %d) is dead: %s", member.worker_id, member.epoch, type(err).__name__)
            self._found_dead(member.worker_id, member.epoch)
        except Exception as err:  # noqa: BLE001 - slow or erroring: keep the last figures; liveness is the controller's
            log.debug("stats of %s unavailable: %s", member.worker_id, type(err).__name__)
        else:
            if self.view.membership.get(member.worker_id) is not member:
                return  # it left (or restarted) while we asked
            self.stats[member.worker_id] = stats
            for listener in self.listeners:
                listener(member.worker_id, member.role, member.epoch, stats)
        self._export(member)

    def _on_membership(self, old: Membership, new: Membership) -> None:
        for member in old.members:
            current = new.get(member.worker_id)
            if current is None or current.epoch != member.epoch:
                self.stats.pop(member.worker_id, None)
                self._dead.discard((member.worker_id, member.epoch))
                if self.metrics is not None and current is None:
                    self.metrics.forget_worker(member.worker_id, member.role)

    def _export(self, member: Member) -> None:
        if self.metrics is not None and self.view.membership.get(member.worker_id) is member:
            stats = self.stats.get(member.worker_id)
            self.metrics.set_worker_load(
                member.worker_id,
                member.role,
                stats.waiting if stats else 0,
                stats.running if stats else 0,
                stats.kv_usage if stats else 0.0,
                healthy=self.is_healthy(member.worker_id),
                epoch=member.epoch,
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
