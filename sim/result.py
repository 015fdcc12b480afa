"""What a simulation returns: one record per request and the figures `splitserve bench` reports.

Definitions are the bench's (loadtest/summary.py, loadtest/records.py), so a simulated and a
measured run compare directly: TTFT from the client's send to the first token it receives; TPOT =
(last token - first token) / (output tokens - 1); a request meets its SLO when it completed and both
hold (an unset SLO is not judged, nor TPOT for a single token); attainment = met / requests;
goodput = met / (last end - first send); percentiles interpolate linearly between ranks.
`loadtest.sim_report` turns a result into the bench's own `Summary` (same table, same JSON).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class SimRecord(NamedTuple):
    index: int  # type: ignore[assignment]  # shadows tuple.index; only ever read as a field
    arrival_s: float
    send_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    first_token_s: float | None  # absolute simulated times, as the client sees them
    last_token_s: float | None
    status: str  # ok, rejected, failed
    migrations: int = 0
    pulled_tokens: int = 0  # of cached_tokens, those a prefix pull brought from another worker
    # rejected: why; "concurrency" (the router's concurrency limit) or the admission policy's cause
    # (`policies.admission.Cause`: queued_tokens, running_requests, kv_usage, kv_blocks, ttft, tpot)
    refusal: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return None
        return (self.last_token_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float:
        return self.last_token_s if self.last_token_s is not None else self.send_s

    def met(self, ttft_slo_s: float | None, tpot_slo_s: float | None) -> bool:
        if not self.ok:
            return False
        ttft_s = self.ttft_s
        if ttft_slo_s is not None and ttft_s is not None and ttft_s > ttft_slo_s:
            return False
        tpot = self.tpot_s
        return tpot_slo_s is None or tpot is None or tpot <= tpot_slo_s


@dataclass(frozen=True)
class SimSummary:
    requests: int
    completed: int
    rejected: int
    failed: int
    duration_s: float
    slo_attainment: float | None
    goodput_per_s: float | None
    throughput_per_s: float | None
    ttft_ms: dict[str, float | None]  # p50, p90, p99, mean
    tpot_ms: dict[str, float | None]
    prefix_hit_rate: float | None

    def ratio_met(self) -> float:
        return self.slo_attainment or 0.0


def percentiles_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = np.asarray(values_s) * 1e3
    p50, p90, p99 = np.percentile(v, [50, 90, 99])  # numpy's linear: the bench's `percentile`
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass
class SimResult:
    config_name: str
    ttft_slo_s: float | None
    tpot_slo_s: float | None
    records: list[SimRecord]
    workers: int  # accelerators (or cores) used
    events: int = 0
    wall_s: float = 0.0
    busy_s: dict[str, float] = field(default_factory=dict)  # summed run time per pool
    handoff_s: float = 0.0  # summed hand-off transfer time
    steps: dict[str, int] = field(default_factory=dict)  # engine steps per pool

    def met(self) -> list[bool]:
        return [r.met(self.ttft_slo_s, self.tpot_slo_s) for r in self.records]

    def summary(self, warmup_s: float = 0.0) -> SimSummary:
        measured = [r for r in self.records if r.arrival_s >= warmup_s]
        done = [r for r in measured if r.ok]
        duration = (max(r.end_s for r in measured) - min(r.send_s for r in measured)) if measured else 0.0
        met = sum(r.met(self.ttft_slo_s, self.tpot_slo_s) for r in measured)
        prompt = sum(r.prompt_tokens for r in done)
        return SimSummary(
            requests=len(measured),
            completed=len(done),
            rejected=sum(r.status == "rejected" for r in measured),
            failed=sum(r.status == "failed" for r in measured),
            duration_s=duration,
            slo_attainment=met / len(measured) if measured else None,
            goodput_per_s=met / duration if duration > 0 else None,
            throughput_per_s=len(done) / duration if duration > 0 else None,
            ttft_ms=percentiles_ms([r.ttft_s for r in done if r.ttft_s is not None]),  # all set when ok
            tpot_ms=percentiles_ms([r.tpot_s for r in done if r.tpot_s is not None]),
            prefix_hit_rate=sum(r.cached_tokens for r in done) / prompt if prompt else None,
        )
