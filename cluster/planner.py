"""The online planner: every interval, the pool sizes the simulator says meet the SLO at least cost.

`Planner.step(observation, current, now_s)` is the whole decision, pure and clock-free (tests drive
it with exact figures); a loop around it reads router metrics into an `Observation` and hands the
result to an actuator (the controller's `scale(role, replicas)`, or the RayCluster patch of
cluster/k8s_actuator.py). The decision:
1. the observed traffic (arrival rate, mean prompt and output lengths over the last interval) becomes
   a synthetic Poisson workload (seeded: the same observation gives the same answer);
2. `least_cost` (cluster/sim/search.py) finds the smallest P + D meeting the SLO for `attainment`
   of it, never below 1 per pool, never above `max_workers`;
3. hysteresis: growth applies at once; a shrink only when the smaller shape also meets the SLO at
   `scale_down_headroom` times the observed rate, for `scale_down_intervals` intervals in a row;
4. cooldown: after any change, nothing more changes for `cooldown_s` (new workers warm up, drained
   ones finish what they have), so the pools never flap.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import NamedTuple

from cluster.sim.config import SimConfig
from cluster.sim.profile import Profile
from cluster.sim.search import least_cost
from cluster.sim.seq import SimRequest


@dataclass(frozen=True)
class PlannerConfig:
    enabled: bool = False
    profile_path: str | None = None  # a `splitserve profile` JSON; required when enabled
    interval_s: float = 30.0
    cooldown_s: float = 120.0
    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0
    attainment: float = 0.9
    max_workers: int = 16
    scale_down_headroom: float = 1.2  # a shrink must hold at this multiple of the observed rate
    scale_down_intervals: int = 2  # consecutive intervals agreeing on a shrink
    window_requests: int = 400  # synthetic requests per decision

    def __post_init__(self):
        for key in ("interval_s", "cooldown_s", "ttft_ms", "tpot_ms"):
            if not getattr(self, key) > 0:
                raise ValueError(f"planner.{key}: must be > 0")
        if not 0 < self.attainment <= 1:
            raise ValueError("planner.attainment: must be in (0, 1]")
        if self.max_workers < 2:
            raise ValueError("planner.max_workers: must be >= 2 (one prefill, one decode)")
        if self.scale_down_headroom < 1:
            raise ValueError("planner.scale_down_headroom: must be >= 1")
        if self.scale_down_intervals < 1 or self.window_requests < 10:
            raise ValueError("planner.scale_down_intervals must be >= 1 and planner.window_requests >= 10")
        if self.enabled and not self.profile_path:
            raise ValueError("planner.profile_path: required when planner.enabled")


class Observation(NamedTuple):
    """What the routers saw over the last interval."""

    arrival_rate_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float


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

    def desired(self, obs: Observation, rate_scale: float = 1.0) -> Pools:
        """The least-cost pools for the observation (the largest allowed when none meets the SLO)."""
        if obs.arrival_rate_per_s <= 0:
            return Pools(1, 1)
        scaled = obs._replace(arrival_rate_per_s=obs.arrival_rate_per_s * rate_scale)
        requests = synthetic_requests(scaled, self.config.window_requests)
        found = least_cost(self.profile, requests, self.base, self.config.max_workers, self.config.attainment)
        if found is None:
            half = self.config.max_workers // 2
            return Pools(self.config.max_workers - half, half)
        return Pools(found.prefill, found.decode)

    def step(self, obs: Observation, current: Pools, now_s: float) -> Pools | None:
        """The pools to scale to now, or None to leave them."""
        if self.last_change_s is not None and now_s - self.last_change_s < self.config.cooldown_s:
            return None
        want = self.desired(obs)
        grow = Pools(max(want.prefill, current.prefill), max(want.decode, current.decode))
        if grow != current and (want.prefill > current.prefill or want.decode > current.decode):
            self._shrink_votes = 0
            return self._changed(grow, now_s)
        if want == current:
            self._shrink_votes = 0
            return None
        safe = self.desired(obs, self.config.scale_down_headroom)
        target = Pools(max(safe.prefill, 1), max(safe.decode, 1))
        if target.prefill >= current.prefill and target.decode >= current.decode:
            self._shrink_votes = 0
            return None
        self._shrink_votes += 1
        if self._shrink_votes < self.config.scale_down_intervals:
            return None
        self._shrink_votes = 0
        return self._changed(Pools(min(target.prefill, current.prefill), min(target.decode, current.decode)), now_s)

    def _changed(self, pools: Pools, now_s: float) -> Pools:
        self.last_change_s = now_s
        return pools
