"""Workers sharing one host's cores: how much longer a step takes when more is busy than there are cores.

A profile times one engine alone (measured: `threads` torch threads, nothing else busy; roofline:
one accelerator). In a real fleet every worker has its own accelerator and nothing here applies
(`SimConfig.host_cores` None, the default). When workers share a host of `cores` CPU cores, as every
process of a test cluster shares this machine, the kernel shares the cores among whatever is
runnable: with `busy` workers stepping, each of `threads` threads, and `background` cores' worth of
other busy processes (a router, a load generator), every step takes

    stretch = max(1, (busy * threads + background) / cores)

times its profiled time. `busy` counts the workers with a run of steps in progress (a worker waiting
for work, for KV room or for a hand-off uses no core). The stretch is re-evaluated whenever a worker
starts or stops being busy: the runs in progress are cut at their next step boundary and continue
at the new stretch (a step already under way keeps the stretch it started with).

What it leaves out: a worker's own side threads (streaming, receiving KV), cache and memory-bandwidth
interference between processes, and the scheduler's unfairness over short intervals.
`benchmarks/host_contention.py` measures the stretch on a real host (README "Validation").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.sim.worker import SimWorker


@dataclass(frozen=True)
class HostShare:
    cores: int
    threads_per_worker: int = 1
    background: float = 0.0  # cores' worth of other busy processes

    def __post_init__(self):
        if self.cores < 1 or self.threads_per_worker < 1 or self.background < 0:
            raise ValueError(f"host sharing needs cores >= 1, threads >= 1, background >= 0, got {self}")

    def stretch(self, busy: int) -> float:
        """How many times its profiled time a step takes while `busy` workers step."""
        return max(1.0, (busy * self.threads_per_worker + self.background) / self.cores)


class SharedHost:
    """Keeps every worker's stretch current as workers start and stop being busy."""

    def __init__(self, share: HostShare):
        self.share = share
        self.busy = 0
        self.current = share.stretch(0)

    def update(self, workers: Sequence[SimWorker], now_s: float) -> list[SimWorker]:
        """Re-counts the busy workers; returns the workers whose run's end moved (to reschedule)."""
        self.busy = sum(w.run is not None and not w.dead for w in workers)
        stretch = self.share.stretch(self.busy)
        if stretch == self.current:
            return []
        self.current = stretch
        return [w for w in workers if w.restretch(now_s, stretch)]
