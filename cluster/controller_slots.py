"""The controller's pool slots: starting, adopting, replacing and draining the worker of each slot.

A slot is one position in a pool ("<cluster>/prefill-0"); its worker id is stable, and each start of
it gets a new epoch. Life of a start: `starting` (actors created, loading) → `serving` (ready, in
membership) → either `draining` (scaled away: out of membership for new requests, stops once idle)
or dead (removed from membership at once, all ranks ended, a new start begun if still wanted).
A start that fails (cannot be placed, crashes while loading) is retried with backoff, forever: the
desired state stands until someone scales it away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import ray

from cluster.controller_state import SlotRecord
from cluster.rendezvous_host import ensure_rendezvous, rendezvous_name
from cluster.worker_actors import end_worker, find_actor, planned_names, start_worker
from common.actor_api import WorkerHandle
from common.membership import DRAINING, SERVING, Member
from common.messages import WorkerInfo
from engine.block_hash import spec_fingerprint

log = logging.getLogger(__name__)
STARTING = "starting"
MAX_BACKOFF_S = 30.0


class ClusterStartError(RuntimeError):
    """The cluster could not start; the message says what did not fit or what failed."""


@dataclass(eq=False)
class Slot:
    worker_id: str
    role: str
    index: int
    epoch: int | None = None
    ranks: tuple | None = None
    actor_names: tuple[str, ...] = ()
    placement_group: str | None = None
    info: WorkerInfo | None = None
    state: str = STARTING
    restarts: int = 0
    strikes: int = 0
    drain_since_s: float = 0.0
    idle_since_s: float | None = None
    last_error: str | None = None
    task: asyncio.Task | None = None

    def record(self) -> SlotRecord:
        assert self.epoch is not None, "only started slots are recorded"
        return SlotRecord(
            self.worker_id,
            self.role,
            self.index,
            self.epoch,
            list(self.actor_names),
            self.placement_group,
            self.state,
            self.restarts,
        )

    def member(self) -> Member:
        assert self.epoch is not None and self.ranks is not None and self.info is not None, "a member is running"
        return Member(self.worker_id, self.role, self.epoch, self.ranks, self.info, self.state, self.restarts)


class SlotStarter:
    def __init__(self, controller):
        self.controller = controller
        self._store: tuple[str, int] | None = None
        self._index = None  # the Redis prefix index, when configured (dead workers' entries are dropped)

    # ---- starting ----------------------------------------------------------------------------------
    def start(self, slot: Slot) -> None:
        self.controller.slots[slot.worker_id] = slot
        slot.task = asyncio.ensure_future(self._start_until_serving(slot))

    async def _start_until_serving(self, slot: Slot) -> None:
        backoff_s = self.controller.config.controller.restart_backoff_s
        while self._wanted(slot):
            try:
                await self._start_once(slot)
                return
            except Exception as err:  # noqa: BLE001 - placement, loading, spec mismatch: say it, end the start, retry
                slot.last_error = f"{type(err).__name__}: {err}"
                log.error("starting %s failed: %s", slot.worker_id, slot.last_error)
                end_worker(slot.ranks or (), slot.placement_group)
                slot.ranks, slot.info, slot.state = None, None, STARTING
                self.controller.record()
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
        self._forget(slot)

    async def _start_once(self, slot: Slot) -> None:
        controller, config = self.controller, self.controller.config
        slot.epoch = controller.state.take_epoch()  # before any await: starts are numbered in start order
        host, port = await self._store_address()
        name = controller.state.cluster_name
        # Recorded before the actors exist: a controller dying in between finds them, or finds them missing.
        slot.actor_names, slot.placement_group = planned_names(name, config, slot.worker_id, slot.role, slot.epoch)
        slot.state, slot.info = STARTING, None
        controller.record(publish=False)
        started = start_worker(
            name, config, controller.state.model_dir, slot.worker_id, slot.role, slot.epoch, host, port
        )
        slot.ranks = started.ranks
        await self._until_ready(slot, config.ready_timeout_s)

    async def _until_ready(self, slot: Slot, timeout_s: float) -> None:
        assert slot.ranks is not None, "ranks started"
        try:
            infos = await asyncio.wait_for(asyncio.gather(*(WorkerHandle(r).ready() for r in slot.ranks)), timeout_s)
        except TimeoutError:
            raise ClusterStartError(
                f"{slot.worker_id} was not ready within {timeout_s:.0f} s; " + self._capacity_hint()
            ) from None
        if infos[0].hash_spec != spec_fingerprint():
            raise ClusterStartError(
                f"worker {slot.worker_id} uses block-hash spec {infos[0].hash_spec!r}, "
                f"the controller {spec_fingerprint()!r}; refusing to mix them"
            )
        slot.info, slot.state, slot.strikes, slot.last_error = infos[0], SERVING, 0, None
        self.controller.record()

    # ---- re-adopting after a controller restart ------------------------------------------------------
    async def adopt_recorded(self) -> bool:
        """Finds the actors of every recorded start; returns True if every serving worker was adopted."""
        adopted_all = True
        waits = []
        for record in self.controller.state.slots:
            slot = Slot(
                record.worker_id,
                record.role,
                record.index,
                record.epoch,
                None,
                tuple(record.actor_names),
                record.placement_group,
                None,
                record.state,
                record.restarts,
            )
            self.controller.slots[slot.worker_id] = slot
            ranks = [find_actor(name) for name in record.actor_names]
            if any(rank is None for rank in ranks):
                adopted_all &= record.state == STARTING
                await self.replace(
                    slot,
                    "gone while the controller was down",
                    publish=False,
                    ranks=tuple(r for r in ranks if r is not None),
                )
                continue
            slot.ranks = tuple(ranks)
            waits.append(self._readopt(slot, record.state))
        results = await asyncio.gather(*waits)
        return adopted_all and all(results)

    async def _readopt(self, slot: Slot, recorded_state: str) -> bool:
        assert slot.ranks is not None, "ranks found"
        try:
            infos = await asyncio.wait_for(
                asyncio.gather(*(WorkerHandle(r).ready() for r in slot.ranks)), self.controller.config.ready_timeout_s
            )
        except Exception as err:  # noqa: BLE001 - dead, slow or erroring rank: replace the instance, as at start
            await self.replace(slot, f"not ready after the controller restart: {type(err).__name__}", publish=False)
            return recorded_state == STARTING
        slot.info, slot.state = infos[0], DRAINING if recorded_state == DRAINING else SERVING
        slot.drain_since_s = time.monotonic()
        return True

    # ---- ending ------------------------------------------------------------------------------------
    async def replace(self, slot: Slot, reason: str, *, publish: bool = True, ranks: tuple | None = None) -> None:
        """The worker is dead, hung or broken: out of membership now, ranks ended, entries dropped, and a
        new start if the slot is still wanted."""
        if slot.task is not None:
            slot.task.cancel()
        end_worker(ranks if ranks is not None else slot.ranks or (), slot.placement_group)
        was_member = slot.info is not None
        slot.ranks, slot.info, slot.last_error = None, None, reason
        self.controller.record(publish=publish)
        if was_member and slot.role == "prefill":
            await self._drop_index_entries(slot.worker_id)
        if self._wanted(slot) and not self.controller._stopping:
            slot.restarts += 1
            slot.state = STARTING
            slot.task = asyncio.ensure_future(self._start_until_serving(slot))
        else:
            self._forget(slot)

    async def progress_drains(self) -> None:
        """Stops each draining worker once it has been idle for `drain_quiet_s` (routers moved on)."""
        quiet_s = self.controller.config.controller.drain_quiet_s
        for slot in [s for s in self.controller.slots.values() if s.state == DRAINING and s.ranks]:
            try:
                stats = await asyncio.wait_for(WorkerHandle(slot.ranks[0]).stats(), quiet_s)
            except Exception:  # noqa: BLE001 - dead or slow: the health check decides; keep it draining
                continue
            busy = stats.waiting or stats.running or stats.in_flight
            now_s = time.monotonic()
            slot.idle_since_s = None if busy else (slot.idle_since_s or now_s)
            overdue = now_s - slot.drain_since_s > self.controller.config.request_timeout_s
            if (slot.idle_since_s is not None and now_s - slot.idle_since_s >= quiet_s) or overdue:
                log.info("drained %s (epoch %d)", slot.worker_id, slot.epoch)
                end_worker(slot.ranks, slot.placement_group)
                self._forget(slot)

    def end(self, slot: Slot) -> None:
        if slot.task is not None:
            slot.task.cancel()
        end_worker(slot.ranks or (), slot.placement_group)

    def _forget(self, slot: Slot) -> None:
        if self.controller.slots.get(slot.worker_id) is slot:
            del self.controller.slots[slot.worker_id]
            self.controller.record()

    def _wanted(self, slot: Slot) -> bool:
        return slot.index < getattr(self.controller.config, slot.role).replicas and slot.state != DRAINING

    # ---- shared resources ----------------------------------------------------------------------------
    async def _store_address(self) -> tuple[str, int]:
        if self._store is None:
            state = self.controller.state
            _, self._store = await ensure_rendezvous(state.cluster_name, self.controller.config.rendezvous_host)
        return self._store

    async def _drop_index_entries(self, worker_id: str) -> None:
        config = self.controller.config
        if config.redis_url is None:
            return  # routers' in-process indexes drop it when it leaves membership
        try:
            if self._index is None:
                from prefix_index import IndexNamespace, make_prefix_index

                info = next(s.info for s in self.controller.slots.values() if s.info is not None)
                namespace = IndexNamespace(info.model_identity, info.block_size)
                self._index = make_prefix_index(config.redis_url, namespace, config.index_lease_s)
            await self._index.remove_worker(worker_id)
        except Exception as err:  # noqa: BLE001 - no live worker to ask the namespace, or Redis down: entries expire
            log.warning("could not drop prefix-index entries of %s: %s", worker_id, err)

    def start_error(self, timeout_s: float) -> ClusterStartError:
        pending = [s for s in self.controller.slots.values() if s.state != SERVING]
        errors = "; ".join(f"{s.worker_id}: {s.last_error}" for s in pending if s.last_error)
        return ClusterStartError(
            f"{len(pending)} worker(s) not serving within {timeout_s:.0f} s"
            + (f" ({errors})" if errors else "")
            + ". "
            + self._capacity_hint()
        )

    def _capacity_hint(self) -> str:
        cfg, available = self.controller.config, ray.cluster_resources()
        gpus = (
            cfg.prefill.replicas * cfg.prefill.num_gpus + cfg.decode.replicas * cfg.decode.tp_size * cfg.decode.num_gpus
        )
        return (
            f"The pools ask for {cfg.num_cpus_needed:g} CPUs (prefill {cfg.prefill.replicas} x "
            f"{cfg.prefill.num_cpus:g}, decode {cfg.decode.replicas} x {cfg.decode.tp_size} ranks x "
            f"{cfg.decode.num_cpus:g}) and {gpus:g} GPUs; the Ray cluster has CPU={available.get('CPU', 0):g}, "
            f"GPU={available.get('GPU', 0):g}"
            + ("; all ranks of a decode instance must fit on one node" if cfg.decode.tp_size > 1 else "")
            + ". Lower the pools' num_cpus/num_gpus or add capacity (or raise ready_timeout_s if loading is slow)."
        )

    async def close(self) -> None:
        if self._index is not None:
            await self._index.close()
        with contextlib.suppress(Exception):  # never created, or already gone
            ray.kill(ray.get_actor(rendezvous_name(self.controller.state.cluster_name)), no_restart=True)
