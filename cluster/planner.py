"""The online planner: every interval, the pool sizes the simulator says meet the SLO at least cost.

`Planner.step(observation, current, now_s)` is the whole decision, pure and clock-free (tests drive
it with exact figures); a loop around it reads router metrics into an `Observation` and hands the
result to an actuator (the controller's `scale(role, replicas)`, or the RayCluster patch of
cluster/k8s_actuator.py). The decision:
1. the observed traffic (arrival rate, mean prompt and output lengths over the last interval) becomes
   a synthetic Poisson workload (seeded: the same observation gives the same answer);
2. growth: when the current pools miss the SLO (for `attainment` of it) in the simulator,
   `least_cost` (sim/search.py) finds the smallest P + D that meets it with no pool smaller
   than now (workers are added, none taken away), within `max_workers`; when only a rebalance fits
   under `max_workers`, the unconstrained least cost; when nothing does, the largest cluster allowed.
   Growth applies at once;
3. hysteresis: pools that meet the SLO shrink only to the least-cost shape with no pool larger than
   now that still meets it at `scale_down_headroom` times the observed rate, and only when
   `scale_down_intervals` intervals in a row agree; never below 1 per pool. (A shape merely
   *different* from the least-cost one is never a reason to move: only a missed SLO or a cheaper
   shape inside the current one is, so a rate between two shapes does not shuffle workers.)
4. cooldown: after any change, nothing more changes for `cooldown_s` (new workers warm up, drained
   ones finish what they have), so the pools never flap;
5. the routers' own verdict vetoes a shrink: while the observed attainment is below the target, the
   profile is too optimistic for what is really served, and fewer workers would only make it worse.
"""

from __future__ import annotations

import dataclasses
import random
from typing import NamedTuple

from common.planner_config import PlannerConfig
from common.traffic import Observation
from sim.config import SimConfig
from sim.profile import Profile
from sim.search import attainment, least_cost
from sim.seq import SimRequest

__all__ = ["Observation", "Planner", "PlannerConfig", "Pools", "synthetic_requests"]


class Pools(NamedTuple):
    prefill: int
    decode: int


def synthetic_requests(obs: Observation, count: int, seed: int = 0) -> list[SimRequest]:
    """Poisson arrivals at the observed rate, exponential lengths around the observed means."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        t += rng.expovariate(obs.arrival_rate_per_s)
        prompt = max(1, round(rng.expovariate(1 / max(obs.mean_prompt_tokens, 1))))
        output = max(1, round(rng.expovariate(1 / max(obs.mean_output_tokens, 1))))
        out.append(SimRequest(t, prompt, output))
    return out


class Planner:
    def __init__(self, config: PlannerConfig, profile: Profile, base: SimConfig | None = None):
        self.config, self.profile = config, profile
        self.base = base or SimConfig()
        self.base = dataclasses.replace(self.base, ttft_slo_s=config.ttft_ms / 1e3, tpot_slo_s=config.tpot_ms / 1e3)
        self.last_change_s: float | None = None
        self._shrink_votes = 0

    def desired(
        self, obs: Observation, rate_scale: float = 1.0, floor: Pools = Pools(1, 1), ceiling: Pools | None = None
    ) -> Pools | None:
        """The least-cost pools for the observation (at `rate_scale` times its rate), each pool within
        [floor, ceiling]; None when no such shape within `max_workers` meets the SLO."""
        if obs.arrival_rate_per_s <= 0:
            return floor
        found = least_cost(
            self.profile,
            self._requests(obs, rate_scale),
            dataclasses.replace(self.base, routers=obs.routers),
            self.config.max_workers,
            self.config.attainment,
            floor=(floor.prefill, floor.decode),
            ceiling=None if ceiling is None else (ceiling.prefill, ceiling.decode),
        )
        return None if found is None else Pools(found.prefill, found.decode)

    def meets(self, obs: Observation, pools: Pools) -> bool:
        """Whether `pools` meet the SLO for the observed traffic (no traffic: trivially)."""
        if obs.arrival_rate_per_s <= 0:
            return True
        config = dataclasses.replace(
            self.base, prefill=pools.prefill, decode=pools.decode, colocated=0, routers=obs.routers
        )
        return attainment(config, self.profile, self._requests(obs)) >= self.config.attainment

    def step(self, obs: Observation, current: Pools, now_s: float) -> Pools | None:
        """The pools to scale to now, or None to leave them."""
        if self.last_change_s is not None and now_s - self.last_change_s < self.config.cooldown_s:
            return None
        if not self.meets(obs, current):
            self._shrink_votes = 0
            grown = self.desired(obs, floor=current) or self.desired(obs) or self._largest()
            return None if grown == current else self._changed(grown, now_s)
        missing_slo = obs.attainment is not None and obs.attainment < self.config.attainment
        safe = None if missing_slo else self.desired(obs, self.config.scale_down_headroom, ceiling=current)
        if safe is None or safe == current:
            self._shrink_votes = 0
            return None
        self._shrink_votes += 1
        if self._shrink_votes < self.config.scale_down_intervals:
            return None
        self._shrink_votes = 0
        return self._changed(safe, now_s)

    def _requests(self, obs: Observation, rate_scale: float = 1.0) -> list[SimRequest]:
        scaled = obs._replace(arrival_rate_per_s=obs.arrival_rate_per_s * rate_scale)
        return synthetic_requests(scaled, self.config.window_requests)

    def _largest(self) -> Pools:
        half = self.config.max_workers // 2
        return Pools(self.config.max_workers - half, half)

    def _changed(self, pools: Pools, now_s: float) -> Pools:
        self.last_change_s = now_s
        return pools
