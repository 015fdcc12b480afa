"""Workers sharing one host's cores: how much longer a step takes when more is busy than there are cores.

A profile times one engine alone (measured: `threads` torch threads, nothing else busy; roofline:
one accelerator). In a real fleet every worker has its own accelerator and nothing here applies
(`SimConfig.host_cores` None, the default). When workers share a host of `cores` CPU cores, as every
process of a test cluster shares this machine, the kernel shares the cores among whatever is
runnable. The demand, in cores, has three parts:
- E = busy * threads + background + handoffs * handoff_cores: `busy` workers with a run of steps in
  progress (a worker waiting for work, for KV room or for a hand-off uses no core), each of `threads`
  threads, `background` cores of processes busy whatever the load (Ray's daemons, the controller's
  loops), and the hand-offs in progress, from their transfer's start to their adoption, each keeping
  `handoff_cores` busy (the sender's and receiver's threads; fitted on prompts sent as another
  request's hand-off starts, loadtest/overlaps.py);
- streaming: outside the engines, every decode step costs the host `stream_cpu_per_step_s` (the
  worker's outbox and the router's poll of it) and every output token `stream_cpu_per_token_s` (the
  router relaying it, the client reading it): ~3.7 ms per token at batch 1 on the dev box, as much
  as the decode step itself. K = those costs at the steps and tokens per second the busy decode
  runs would make at their profiled step times; at stretch s they go s times slower, so this part
  of the demand is K / s. Each of streaming's wake-ups also preempts an engine thread, which then
  refills its caches and waits its turn back: engines slow down by more than the CPU the streaming
  threads burn (measured on the dev box: a prefill overlapping one batch-1 decode stream took a
  median 1.5x its time alone, where the CPU figures alone give 1.3x). `stream_interference` (>= 1,
  fitted by the calibration's bursts, loadtest/host_cpu.py) multiplies K for that, and a prefill
  worker, whose steps are long enough to be preempted again and again, feels K `prefill_interference`
  times more (fitted on prompts sent while other requests stream, loadtest/overlaps.py, on each
  cluster shape, once the decode steps are measured: the decode engines' own step timings hold
  their stretch, and what a prefill overlapping decode streams loses beyond it is this factor's).
Every step takes `stretch` times its profiled time, where s * cores = E + K / s once the demand
exceeds the cores:

    stretch = 1                                            if E + K <= cores
    stretch = (E + sqrt(E^2 + 4 * cores * K)) / (2 * cores)  otherwise

(K = 0: max(1, E / cores)). The stretch is re-evaluated whenever a worker starts or ends a run (a
decode batch changes size, a worker starts or stops being busy) and, with `handoff_cores`, whenever a
hand-off starts or ends: the runs in progress are cut at
their next step boundary and continue at the new stretch (a step already under way keeps the
stretch it started with).

What it leaves out: the GIL shared by a worker's engine thread and its own side threads (the
calibration measures its effect instead: a per-step overhead and the prefill step scale,
loadtest/calibrate.py), cache and memory-bandwidth interference between processes, and the
scheduler's unfairness over short intervals (the model shares the cores fairly; the kernel and the
GIL do not, nor does it draw steps' jitter: part of why its tails and p50s miss). `benchmarks/host_contention.py`
measures the stretch on a real host (README "Validation").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sim.config import SimConfig
from sim.worker import SimWorker


@dataclass(frozen=True)
class HostShare:
    cores: int
    threads_per_worker: int = 1
    background: float = 0.0  # cores' worth of other busy processes
    stream_cpu_per_step_s: float = 0.0  # host CPU outside the engines per decode step
    stream_cpu_per_token_s: float = 0.0  # and per output token streamed
    stream_interference: float = 1.0  # streaming's demand as the engines feel it, over its CPU time
    prefill_interference: float = 1.0  # and as a prefill engine feels it, over that
    handoff_cores: float = 0.0  # cores each hand-off in progress keeps busy (sender, receiver, adoption)

    def __post_init__(self):
        costs = (self.background, self.stream_cpu_per_step_s, self.stream_cpu_per_token_s, self.handoff_cores)
        interference = min(self.stream_interference, self.prefill_interference)
        if self.cores < 1 or self.threads_per_worker < 1 or min(costs) < 0 or not interference >= 1:
            raise ValueError(
                "host sharing needs cores >= 1, threads >= 1, background and streaming >= 0, "
                f"interference >= 1, got {self}"
            )

    def stretch(
        self, busy: int, steps_per_s: float = 0.0, tokens_per_s: float = 0.0, prefill: bool = False, handoffs: int = 0
    ) -> float:
        """How many times its profiled time a step (of a prefill worker: `prefill`) takes while `busy`
        workers step, `handoffs` hand-offs are in progress and decode runs would make `steps_per_s`
        steps and `tokens_per_s` output tokens per second unstretched."""
        engines = busy * self.threads_per_worker + self.background + handoffs * self.handoff_cores
        streaming = self.stream_cpu_per_step_s * steps_per_s + self.stream_cpu_per_token_s * tokens_per_s
        streaming *= self.stream_interference * (self.prefill_interference if prefill else 1.0)
        if engines + streaming <= self.cores:
            return 1.0
        return (engines + math.sqrt(engines * engines + 4.0 * self.cores * streaming)) / (2.0 * self.cores)


def host_share(config: SimConfig, threads_per_worker: int) -> HostShare:
    """The host of `config` (its `host_cores` set), with workers of `threads_per_worker` threads."""
    assert config.host_cores is not None, "workers share a host only when host_cores is set"
    return HostShare(
        config.host_cores,
        threads_per_worker,
        config.host_background_cores,
        config.host_stream_cpu_per_step_s,
        config.host_stream_cpu_per_token_s,
        config.host_stream_interference,
        config.host_prefill_interference,
        config.host_handoff_cores,
    )


class SharedHost:
    """Keeps every worker's stretch current as workers start and stop being busy."""

    def __init__(self, share: HostShare):
        self.share = share
        self.busy = 0
        self.current = {False: share.stretch(0), True: share.stretch(0, prefill=True)}  # by "is a prefill worker"

    def stretch_of(self, role: str) -> float:
        return self.current[role == "prefill"]

    def update(self, workers: Sequence[SimWorker], now_s: float, handoffs: int = 0) -> list[SimWorker]:
        """Re-counts the busy workers (and takes the `handoffs` in progress); returns the workers whose
        run's end moved (to reschedule)."""
        self.busy = sum(w.run is not None and not w.dead for w in workers)
        rates = [w.decode_rates_per_s() for w in workers]
        steps_per_s, tokens_per_s = sum(r[0] for r in rates), sum(r[1] for r in rates)
        current = {p: self.share.stretch(self.busy, steps_per_s, tokens_per_s, p, handoffs) for p in self.current}
        if current == self.current:
            return []
        self.current = current
        return [w for w in workers if w.restretch(now_s, self.stretch_of(w.role))]
