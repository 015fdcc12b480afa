"""How long a live cluster's engines stepped, per pool: the measured side of the simulator's busy time.

Every worker's engine loop records each step's wall time (`splitserve_worker_step_duration_seconds`,
common/worker_metrics.py) on its Prometheus endpoint (the pool's `metrics_port`). `pool_steps`
reads the summed step seconds and step counts of each pool; the difference of two readings is what
the engines did in between, to set beside the simulation's `SimResult.busy_s` and `steps`. Where the
two agree and the latencies do not, the time went outside the engines' steps (queues, hand-offs,
streaming); where the engines stepped longer than simulated, their steps were slower than modelled.
"""

from __future__ import annotations

from typing import NamedTuple

import ray

from common.metrics_http import scrape
from engine.step_log import StepRecord

STEP_SUM, STEP_COUNT = "splitserve_worker_step_duration_seconds_sum", "splitserve_worker_step_duration_seconds_count"
STATS_TIMEOUT_S = 10.0


class PoolSteps(NamedTuple):
    seconds: float
    steps: int
    recent: tuple[StepRecord, ...] = ()  # the pool's workers' newest steps (up to 64 each, as stats gives)

    def minus(self, earlier: PoolSteps) -> PoolSteps:
        return PoolSteps(self.seconds - earlier.seconds, self.steps - earlier.steps, self.recent)


def pool_steps(cluster, host: str = "127.0.0.1") -> dict[str, PoolSteps]:
    """{"prefill": ..., "decode": ...}: each pool's summed engine step seconds and steps so far, and its
    workers' newest step records. The pools need a metrics port (PoolConfig.metrics_port, 0 for any
    free one)."""
    out = {}
    for pool, handles in (("prefill", cluster.prefill), ("decode", cluster.decode)):
        seconds, steps, recent = 0.0, 0, []
        for handle in handles:
            stats = ray.get(handle.actor.stats.remote(), timeout=STATS_TIMEOUT_S)
            if stats.metrics_port is None:
                raise ValueError(f"{pool} worker has no metrics endpoint: set the pool's metrics_port")
            samples = scrape(f"http://{host}:{stats.metrics_port}/metrics")
            seconds += sum(v for (name, _), v in samples.items() if name == STEP_SUM)
            steps += int(sum(v for (name, _), v in samples.items() if name == STEP_COUNT))
            recent += stats.steps
        out[pool] = PoolSteps(seconds, steps, tuple(recent))
    return out
