"""Sizing pools with the simulator: per-worker goodput of each shape, and the least cluster for a load.

`max_rate`: the highest request rate (the workload's arrivals compressed or stretched in time,
its lengths and prefixes unchanged) at which a cluster still meets the SLO for `attainment` of the
requests; a bisection over the time scale, each step one simulation. DistServe's per-GPU goodput
is that rate over the accelerators the cluster uses (`SimConfig.workers`: a decode instance counts
its TP ranks).
`search`: every disaggregated shape (P prefill workers, D decode instances of each TP size) and every
colocated one within `max_workers`, ranked by per-worker goodput: the table `splitserve plan` prints.
`least_cost`: the fewest workers (then the most prefill among equals) that meet the SLO at the
workload's own rate: what the online planner scales to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from sim.config import SimConfig
from sim.profile import Profile
from sim.seq import SimRequest
from sim.simulator import simulate


class PlanRow(NamedTuple):
    config: SimConfig
    max_rate_per_s: float  # highest rate meeting the attainment target (0: not even the slowest tried)
    per_worker: float  # max_rate_per_s / workers
    simulations: int

    @property
    def name(self) -> str:
        return self.config.name


def rescaled(requests: Sequence[SimRequest], factor: float) -> list[SimRequest]:
    """The same requests arriving `factor` times as fast (from the first arrival)."""
    start = requests[0].arrival_s if requests else 0.0
    return [r._replace(arrival_s=start + (r.arrival_s - start) / factor) for r in requests]


def base_rate(requests: Sequence[SimRequest]) -> float:
    span_s = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span_s if span_s > 0 else float(len(requests))


def attainment(config: SimConfig, profile: Profile, requests: Sequence[SimRequest]) -> float:
    return simulate(config, profile, requests).summary().slo_attainment or 0.0


def max_rate(
    config: SimConfig, profile: Profile, requests: Sequence[SimRequest], target: float, steps: int = 12
) -> tuple[float, int]:
    """(the highest rate meeting `target`, simulations run); bisection on a log scale of the time factor."""
    rate0, runs = base_rate(requests), 0

    def ok(factor: float) -> bool:
        nonlocal runs
        runs += 1
        return attainment(config, profile, rescaled(requests, factor)) >= target

    lo, hi = 1.0, 1.0
    if ok(1.0):
        while ok(hi * 2) and hi < 2**20:
            hi *= 2
        lo, hi = hi, hi * 2
    else:
        while not ok(lo / 2):
            lo /= 2
            if lo < 2**-20:
                return 0.0, runs
        lo, hi = lo / 2, lo
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return rate0 * lo, runs


def shapes(base: SimConfig, max_workers: int, tp_sizes: Sequence[int]) -> list[SimConfig]:
    out = []
    for tp in tp_sizes:
        out += [
            dataclasses.replace(base, prefill=p, decode=d, tp=tp, colocated=0)
            for p in range(1, max_workers)
            for d in range(1, max_workers)
            if p + d * tp <= max_workers
        ]
        out += [
            dataclasses.replace(base, prefill=0, decode=0, tp=tp, colocated=c) for c in range(1, max_workers // tp + 1)
        ]
    return out


def search(
    profile: Profile,
    requests: Sequence[SimRequest],
    base: SimConfig,
    max_workers: int,
    target: float,
    tp_sizes: Sequence[int] = (1,),
) -> list[PlanRow]:
    """Every shape within `max_workers`, best per-worker goodput first."""
    rows = []
    for config in shapes(base, max_workers, tp_sizes):
        rate, runs = max_rate(config, profile, requests, target)
        rows.append(PlanRow(config, rate, rate / config.workers, runs))
    return sorted(rows, key=lambda r: (-r.per_worker, r.config.workers, r.name))


def least_cost(
    profile: Profile,
    requests: Sequence[SimRequest],
    base: SimConfig,
    max_workers: int,
    target: float,
    floor: tuple[int, int] = (1, 1),
    ceiling: tuple[int, int] | None = None,
) -> SimConfig | None:
    """The smallest (prefill, decode) cluster, each pool at least its floor (and at most its ceiling),
    meeting `target` at the requests' own rate; among equal sizes, the one with the best attainment.
    None: none within `max_workers` (and the ceiling)."""
    top = ceiling or (max_workers, max_workers)
    for total in range(sum(floor), min(max_workers, sum(top)) + 1):
        best = None
        for prefill in range(max(floor[0], total - top[1]), min(top[0], total - floor[1]) + 1):
            config = dataclasses.replace(base, prefill=prefill, decode=total - prefill, colocated=0)
            met = attainment(config, profile, requests)
            if met >= target and (best is None or met > best[0]):
                best = (met, config)
        if best is not None:
            return best[1]
    return None
