"""The online planner in the product: a task of the controller, one decision per `planner.interval_s`.

Why the controller hosts it: there is exactly one per cluster (routers are many stateless peers, and
a planner per router would vote against each other), it already owns the desired pool sizes and
`scale(role, replicas)` with drain on the way down, and Ray restarts it when it dies. Routers call
down into it (`report_traffic`, common/traffic.py); nothing here knows about routers.

Each round:
1. the routers' reports over the last interval become one `Observation` (rate, mean lengths, the
   share of finished requests within the planner's SLO);
2. `Planner.step` (cluster/planner.py) simulates it on the profile and applies hysteresis and
   cooldown; the simulation runs on a thread so health checks and membership long-polls go on;
3. a change goes through the controller's own `scale`. With `planner.raycluster_name` (Kubernetes),
   growth patches the RayCluster's worker group first (pods must exist before actors can be placed
   on them); a shrink drains first and patches later: once the drained workers have stopped, the
   group's replicas go down naming their pods in `scaleStrategy.workersToDelete` (KubeRay removes
   no pod on its own choice when replicas drop, and a random one could be serving).
Every round is kept (`rounds`, newest last, bounded) for `planner_status` and the tests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import NamedTuple

from cluster.planner import Planner, Pools
from common.actor_api import WorkerHandle
from common.config import ClusterConfig
from common.traffic import Observation, TrafficCounts, TrafficWindow
from sim.config import SimConfig
from sim.profile import Profile
from sim.worker import EngineLimits

log = logging.getLogger(__name__)
KEEP_ROUNDS = 100


class PlannerRound(NamedTuple):
    at_s: float  # time.monotonic() of the controller when the round decided
    observation: Observation
    current: Pools
    decision: Pools | None  # None: left as they were
    took_s: float  # how long the simulation took


class PendingRemoval(NamedTuple):
    role: str
    replicas: int
    worker_ids: tuple[str, ...]  # the drained workers whose pods go once they stopped
    pods: tuple[str, ...]


def sim_base(config: ClusterConfig) -> SimConfig:
    """The simulated cluster mirroring the running one: engine limits, decode TP, routing policy."""
    pool = config.prefill
    policy = "round_robin" if config.router.policy == "round_robin" else "cache_aware"
    return SimConfig(
        tp=config.decode.tp_size,
        limits=EngineLimits(pool.max_num_seqs, pool.max_num_batched_tokens, pool.prefill_chunk_tokens),
        enable_prefix_caching=config.enable_prefix_caching,
        policy=policy,
        migration_limit=config.router.migration_limit,
        router_max_requests=config.router.max_concurrent_requests,
    )


class PlannerLoop:
    """`controller`: the ClusterController (its `config` holds the pools as scaled, `slots` the live
    workers, `scale` drains on the way down); `actuator`: a RayClusterActuator on Kubernetes, else None."""

    def __init__(self, controller, actuator=None):
        self.controller, self.actuator = controller, actuator
        self.config = controller.config.planner
        self.planner = Planner(self.config, Profile.load(self.config.profile_path), sim_base(controller.config))
        self.window = TrafficWindow(keep_s=2 * self.config.interval_s)
        self.rounds: deque[PlannerRound] = deque(maxlen=KEEP_ROUNDS)
        self.pending: list[PendingRemoval] = []
        self._started_s = time.monotonic()

    @property
    def pools(self) -> Pools:
        """The desired pools as the controller holds them now (an operator's `scale` included)."""
        config = self.controller.config
        return Pools(config.prefill.replicas, config.decode.replicas)

    def report(self, router_id: str, counts: TrafficCounts) -> None:
        self.window.add(router_id, counts, time.monotonic())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad round (an API server hiccup) must not end planning
                log.exception("planner round failed")

    async def round(self) -> PlannerRound:
        now_s = time.monotonic()
        window_s = min(self.config.interval_s, now_s - self._started_s)
        observation = self.window.observe(now_s, max(window_s, 1e-3))
        current = self.pools
        decision = await asyncio.to_thread(self.planner.step, observation, current, now_s)
        done = PlannerRound(now_s, observation, current, decision, time.monotonic() - now_s)
        self.rounds.append(done)
        if decision is not None:
            log.info("planner: %s at %.2f req/s -> %s", current, observation.arrival_rate_per_s, decision)
            await self._apply(current, decision)
        await self._finish_removals()
        return done

    async def _apply(self, current: Pools, target: Pools) -> None:
        for role in ("prefill", "decode"):
            have, want = getattr(current, role), getattr(target, role)
            if want > have:
                if self.actuator is not None:
                    await asyncio.to_thread(self.actuator.scale, role, want)
                await self.controller.scale(role, want)
            elif want < have:
                leaving = [s for s in self.controller.slots.values() if s.role == role and s.index >= want]
                pods = await _hostnames(leaving) if self.actuator is not None else ()
                await self.controller.scale(role, want)
                if self.actuator is not None:
                    self.pending.append(PendingRemoval(role, want, tuple(s.worker_id for s in leaving), pods))

    async def _finish_removals(self) -> None:
        """Patch the RayCluster for each shrink whose drained workers have all stopped."""
        slots = self.controller.slots
        for removal in list(self.pending):
            if not any(worker_id in slots for worker_id in removal.worker_ids):
                await asyncio.to_thread(self.actuator.scale, removal.role, removal.replicas, removal.pods)
                self.pending.remove(removal)

    def status(self) -> dict:
        rounds = [
            {
                **r._asdict(),
                "observation": r.observation._asdict(),
                "current": r.current._asdict(),
                "decision": r.decision and r.decision._asdict(),
            }
            for r in self.rounds
        ]
        return {
            "pools": self.pools._asdict(),
            "rounds": rounds,
            "pending_removals": [p._asdict() for p in self.pending],
        }


async def _hostnames(slots) -> tuple[str, ...]:
    """The host (on KubeRay: the pod) of every rank of the slots, asked of the actors themselves."""
    calls = [WorkerHandle(rank).hostname() for slot in slots for rank in (slot.ranks or ())]
    try:
        names = await asyncio.wait_for(asyncio.gather(*calls), 10.0)
    except Exception:  # a rank already gone: KubeRay then removes nothing for it, the pod idles
        log.warning("planner: could not ask every leaving worker for its pod", exc_info=True)
        return ()
    return tuple(sorted(set(names)))
