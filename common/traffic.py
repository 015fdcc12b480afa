"""What routers tell the controller about their traffic, and the controller's sum over routers.

The online planner runs in the controller (cluster/planner_loop.py): there is one per cluster, it
owns `scale`, and it outlives any router. Routers are many stateless peers, so each counts only what
it served itself (`TrafficCounts`: cumulative counters, cheap to bump on the request path) and
reports them every `planner.report_interval_s` through the controller's `report_traffic`. Counters
are cumulative, not deltas: a report lost to a controller restart or a slow call costs nothing, the
next one carries it. `TrafficWindow` (in the controller) turns each router's successive reports into
deltas stamped with the controller's clock and sums them over the planner's interval into one
`Observation` for the whole cluster. A router that restarts starts its counters again from zero;
a report smaller than the previous one from the same router id is taken as that fresh start.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from typing import NamedTuple


@dataclass(frozen=True)
class TrafficCounts:
    """A router's cumulative counters since it started (the message routers send)."""

    arrivals: int = 0  # requests accepted for routing (SLO admission may still refuse some: demand)
    prompt_tokens: int = 0  # over those arrivals
    finished: int = 0  # requests that ended with their last token
    output_tokens: int = 0  # over those finished requests
    slo_met: int = 0  # finished requests within the planner's TTFT and TPOT targets

    def minus(self, other: TrafficCounts) -> TrafficCounts:
        return TrafficCounts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def plus(self, other: TrafficCounts) -> TrafficCounts:
        return TrafficCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def is_before(self, other: TrafficCounts) -> bool:
        """True when `other` could follow this one from the same router (no counter went down)."""
        return all(getattr(self, f.name) <= getattr(other, f.name) for f in fields(self))


class Observation(NamedTuple):
    """What the routers saw together over the last interval."""

    arrival_rate_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    attainment: float | None = None  # share of finished requests within the SLO; None: none finished
    routers: int = 1  # routers whose reports arrived in the interval (each has its own request limit)


class TrafficWindow:
    """The controller's deltas from every router, kept for `keep_s` seconds of its clock."""

    def __init__(self, keep_s: float):
        self.keep_s = keep_s
        self._last: dict[str, TrafficCounts] = {}  # router id -> its latest cumulative counts
        self._deltas: deque[tuple[str, float, TrafficCounts]] = deque()  # (router, received at, delta), oldest first
        self._lengths = (0.0, 0.0)  # the last known mean lengths: kept through an interval with no traffic

    def add(self, router_id: str, counts: TrafficCounts, now_s: float) -> None:
        last = self._last.get(router_id, TrafficCounts())
        delta = counts.minus(last) if last.is_before(counts) else counts  # restarted router: a fresh count
        self._last[router_id] = counts
        self._deltas.append((router_id, now_s, delta))
        while self._deltas and self._deltas[0][1] < now_s - self.keep_s:
            self._deltas.popleft()

    def forget(self, router_id: str) -> None:
        self._last.pop(router_id, None)

    def observe(self, now_s: float, window_s: float) -> Observation:
        """The cluster's traffic over the `window_s` seconds before `now_s`."""
        total, reporting = TrafficCounts(), set()
        for router_id, received_s, delta in self._deltas:
            if now_s - window_s < received_s <= now_s:
                total = total.plus(delta)
                reporting.add(router_id)
        prompt, output = self._lengths
        if total.arrivals:
            prompt = total.prompt_tokens / total.arrivals
        if total.finished:
            output = total.output_tokens / total.finished
        self._lengths = (prompt, output)
        met = total.slo_met / total.finished if total.finished else None
        return Observation(total.arrivals / window_s, prompt, output, met, max(1, len(reporting)))
