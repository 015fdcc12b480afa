"""The cluster controller: one named, detached Ray actor per cluster that owns the worker pools.

It owns the desired state (the pools of the one `ClusterConfig`, with every `scale` applied), starts
the workers (each start a new epoch), health-checks them, replaces the dead, drains on the way down,
and publishes `Membership` with a version that routers follow by long-poll (`watch`). It hosts what
the cluster shares: the rendezvous store (through its own actor, `cluster/rendezvous_host.py`), the
cluster id, the hash spec and model identity its workers must agree on. Nothing else starts or kills
workers; routers are stateless peers that only read membership. How health checks, scaling, the
planner and a controller restart behave: docs/architecture.md, Control plane.

Health pings go to the worker's event loop, never its engine, so a busy worker is not a dead one; a
dead, hung (`health_failures` pings unanswered) or broken worker leaves membership at once, with all
its ranks and its prefix-index entries, and a replacement starts. With `planner.enabled` the online
planner runs here (cluster/planner_loop.py): routers report their traffic through `report_traffic`,
and it scales through `scale`. Ray restarts a dead controller (`max_restarts`), which re-adopts the
live workers from its record in Ray's GCS (`cluster/controller_state.py`); no worker restarts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import time
from typing import TYPE_CHECKING

from ray.exceptions import ActorDiedError, RayActorError

from cluster.controller_slots import Slot, SlotStarter
from cluster.controller_state import ControllerState
from cluster.membership_feed import MembershipFeed
from cluster.planner_loop import PlannerLoop
from common.actor_api import ControllerApi, WorkerHandle
from common.config import ClusterConfig, ConfigError, config_conflicts
from common.logs import configure_logging_from_env
from common.membership import DRAINING, ROLES, SERVING, Member, Membership, MembershipDelta
from common.messages import Liveness
from common.traffic import TrafficCounts

log = logging.getLogger(__name__)
CONTROLLER_PREFIX = "splitserve-controller:"


def controller_name(cluster_name: str) -> str:
    return CONTROLLER_PREFIX + cluster_name


class ClusterController:
    def __init__(self, cluster_name: str, config: dict, model_dir: str):
        configure_logging_from_env()  # --log-level / --log-format of the serve command
        state = ControllerState.load(cluster_name)
        self.adopting = state is not None
        if state is None:  # a new cluster; a restarted controller ignores its arguments for the record
            config = {**config, "cluster_name": cluster_name, "model_dir": model_dir}
            state = ControllerState(cluster_name, secrets.token_hex(3), config, model_dir)
            state.save()
        self.state = state
        self.config = ClusterConfig.from_dict(state.config)
        self.slots: dict[str, Slot] = {}
        self.starter = SlotStarter(self)
        self._feed = MembershipFeed(Membership(state.cluster_id, state.version))
        self._ready = asyncio.Event()  # set once re-adoption (or the first reconcile) is done
        self._stopping = False
        self.planner: PlannerLoop | None = None
        self.planner_error: str | None = None
        self._planner_task: asyncio.Task | None = None
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    # ---- API ---------------------------------------------------------------------------------------
    async def membership(self) -> Membership:
        await self._ready.wait()
        return self._feed.current

    async def watch(self, known_version: int, timeout_s: float) -> Membership:
        """The membership once its version differs from `known_version`, or the current one after
        `timeout_s` (long-poll: routers call it in a loop)."""
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        return await self._feed.watch(known_version, timeout_s)

    async def watch_delta(self, cluster_id: str, known_version: int, timeout_s: float) -> Membership | MembershipDelta:
        """As `watch`, answered as the change from the watcher's version when the controller still has
        it (cluster/membership_feed.py): what routers follow, so a fleet's watchers cost little."""
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        return await self._feed.watch_delta(cluster_id, known_version, timeout_s)

    async def wait_ready(self, timeout_s: float) -> Membership:
        """Returns once every desired worker is serving; raises ClusterStartError (naming what could not
        start, e.g. resources Ray cannot place) when that takes longer than `timeout_s`."""
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self._at_strength():
                return self._feed.current
            await asyncio.sleep(0.05)
        raise self.starter.start_error(timeout_s)

    async def progress(self) -> str:
        """One line: how many workers of each pool serve, and the latest start error if any."""
        counts = [
            f"{role} {sum(s.role == role and s.state == SERVING for s in self.slots.values())}/"
            f"{getattr(self.config, role).replicas} serving"
            for role in ROLES
        ]
        errors = [f"{s.worker_id}: {s.last_error}" for s in self.slots.values() if s.last_error and s.state != SERVING]
        return ", ".join(counts) + (f" (last error: {errors[0]})" if errors else " (loading)")

    async def cluster_config(self) -> dict:
        """The running cluster's config (desired state, as scaled) as plain data."""
        return dict(self.state.config)

    async def check_join(self, given: dict) -> None:
        """Raises ConfigError naming every key a joining command gave that differs from this cluster's."""
        conflicts = config_conflicts(given, self.state.config)
        if conflicts:
            raise ConfigError(
                f"cluster {self.state.cluster_name!r} is running with another config: " + "; ".join(conflicts)
            )

    async def scale(self, role: str, replicas: int) -> None:
        """Grow or shrink a pool. Shrinking drains the highest slots: they leave membership (no new
        requests), finish what they have, then stop. Returns at once; `wait_ready` waits for growth."""
        if role not in ROLES:
            raise ConfigError(f"role: must be one of {list(ROLES)}, got {role!r}")
        raw = {**self.state.config, role: {**self.state.config[role], "replicas": replicas}}
        self.config = ClusterConfig.from_dict(raw)  # validates (replicas >= 1)
        self.state.config = raw
        self.state.save()
        await self._reconcile()

    async def report_traffic(self, router_id: str, counts: TrafficCounts) -> bool:
        """A router's cumulative traffic counters (common/traffic.py). False: no planner runs here."""
        if self.planner is None:
            return False
        self.planner.report(router_id, counts)
        return True

    async def planner_status(self) -> dict | None:
        """The planner's pools and recent rounds (observation, decision); {"error": ...} when it could not
        start; None when it is off."""
        if self.planner is None:
            return {"error": self.planner_error} if self.planner_error else None
        return self.planner.status()

    async def kill_worker(self, worker_id: str, rank: int = 0) -> bool:
        """Chaos: SIGKILL the process of one rank of a worker (no polite stop). False: no such worker."""
        slot = self.slots.get(worker_id)
        if slot is None or slot.ranks is None or rank >= len(slot.ranks):
            return False
        WorkerHandle(slot.ranks[rank]).debug_signal(signal.SIGKILL)
        return True

    async def shutdown(self) -> None:
        """Ends every worker and forgets the cluster (the caller then kills this actor)."""
        self._stopping = True
        self._task.cancel()
        if self._planner_task is not None:
            self._planner_task.cancel()
        for slot in list(self.slots.values()):
            self.starter.end(slot)
        await self.starter.close()
        ControllerState.delete(self.state.cluster_name)

    async def ping(self) -> str:
        return self.state.cluster_id

    async def pid(self) -> int:
        """This controller's process id (fault injection in tests kills it)."""
        return os.getpid()

    # ---- supervision -------------------------------------------------------------------------------
    async def _supervise(self) -> None:
        try:  # nothing is published until this is done: a restarted controller resumes the same version
            adopted_all = await self.starter.adopt_recorded()
            self._feed.restore(Membership(self.state.cluster_id, self.state.version, self._members()))
            self._ready.set()
            if not adopted_all:
                self._publish(force=True)
            await self._reconcile()
        finally:
            self._ready.set()
        self._start_planner()
        while not self._stopping:
            await asyncio.sleep(self.config.controller.health_interval_s)
            try:
                await self._check_health()
                await self._reconcile()
                await self.starter.progress_drains()
            except Exception:  # never let one bad round end supervision
                log.exception("controller supervision round failed")

    def _start_planner(self) -> None:
        planner = self.config.planner
        if not planner.enabled:
            return
        try:  # an unreadable profile or no service-account token: the pools keep serving as they are
            actuator = None
            if planner.raycluster_name is not None:
                from cluster.k8s_actuator import in_cluster

                actuator = in_cluster(planner.raycluster_name, planner.raycluster_namespace, self.config.decode.tp_size)
            self.planner = PlannerLoop(self, actuator)
        except Exception as err:
            self.planner_error = f"{type(err).__name__}: {err}"
            log.exception("the planner could not start")
            return
        self._planner_task = asyncio.get_running_loop().create_task(self.planner.run())

    async def _check_health(self) -> None:
        watched = [s for s in self.slots.values() if s.ranks is not None and s.state in (SERVING, DRAINING)]
        verdicts = await asyncio.gather(*(self._probe(slot) for slot in watched))
        for slot, verdict in zip(watched, verdicts, strict=True):
            if verdict is not None:
                log.warning("worker %s (epoch %d) is %s", slot.worker_id, slot.epoch, verdict)
                await self.starter.replace(slot, verdict)

    async def _probe(self, slot: Slot) -> str | None:
        """None while healthy; else why the worker must go."""
        timeout_s = self.config.controller.health_timeout_s
        assert slot.ranks is not None, "only running slots are probed"
        try:
            answers = await asyncio.wait_for(asyncio.gather(*(WorkerHandle(r).ping() for r in slot.ranks)), timeout_s)
        except (ActorDiedError, RayActorError) as err:
            if isinstance(err, ActorDiedError) or "died" in str(err).lower():
                return f"dead ({type(err).__name__})"
            slot.strikes += 1
        except TimeoutError:
            slot.strikes += 1
        else:
            broken = [a.error for a in answers if isinstance(a, Liveness) and not a.engine_ok]
            if broken:
                return f"broken (engine loop: {broken[0]})"
            slot.strikes = 0
            return None
        limit = self.config.controller.health_failures
        return f"hung ({slot.strikes} health checks unanswered)" if slot.strikes >= limit else None

    async def _reconcile(self) -> None:
        for role in ROLES:
            replicas = getattr(self.config, role).replicas
            for index in range(replicas):
                worker_id = f"{self.state.cluster_name}/{role}-{index}"
                if worker_id not in self.slots:
                    self.starter.start(Slot(worker_id, role, index))
            for slot in self.slots.values():
                if slot.role == role and slot.index >= replicas and slot.state == SERVING:
                    slot.state = DRAINING
                    slot.drain_since_s = time.monotonic()
                    self.record()

    def _at_strength(self) -> bool:
        return all(
            sum(s.role == role and s.state == SERVING for s in self.slots.values())
            >= getattr(self.config, role).replicas
            for role in ROLES
        )

    # ---- publishing --------------------------------------------------------------------------------
    def record(self, *, publish: bool = True) -> None:
        """Persist the slots (a restarted controller finds them) and publish membership if it changed."""
        self.state.slots = [slot.record() for slot in self.slots.values() if slot.epoch is not None]
        self.state.save()
        if publish:
            self._publish()

    def _members(self) -> tuple[Member, ...]:
        ordered = sorted(self.slots.values(), key=lambda s: (ROLES.index(s.role), s.index))
        return tuple(
            slot.member()
            for slot in ordered
            if slot.info is not None and slot.ranks is not None and slot.state in (SERVING, DRAINING)
        )

    def _publish(self, force: bool = False) -> None:
        if not self._ready.is_set():
            return  # still re-adopting: the membership is published once, whole, afterwards
        members = self._members()
        if not force and _same(members, self._feed.current.members):
            return
        self.state.version += 1
        self.state.save()
        membership = Membership(self.state.cluster_id, self.state.version, members)
        self._feed.publish(membership)
        for member in members:  # workers follow too: peers for prefix pulls, channels to close
            for rank in member.ranks:
                WorkerHandle(rank).set_membership(membership)


def _same(a: tuple[Member, ...], b: tuple[Member, ...]) -> bool:
    key = lambda m: (m.worker_id, m.epoch, m.state)  # noqa: E731
    return [key(m) for m in a] == [key(m) for m in b]


if TYPE_CHECKING:  # mypy holds the actor to its remote interface
    _implements: type[ControllerApi] = ClusterController
