"""Reduces a run's records to the figures the bench reports (summary.json and the printed table).

Definitions (all recomputable from records.jsonl; see `records` for TTFT / TPOT / ITL / met_slo):
- Measured requests: every issued request whose arrival_s >= warmup_s. Latency distributions cover the
  completed ones (finish reason, no error); failures are counted, not timed.
- duration_s: first send -> last end among measured requests.
- Request throughput: completed / duration_s. Output-token throughput: every output token received
  (failed requests' partial output included: the cluster did that work) / duration_s.
- SLO attainment: measured requests that met their SLO / measured requests (a rejected or failed
  request did not meet it).
- Goodput (DistServe's notion, per run): requests per second that completed AND met their SLO,
  = met / duration_s. DistServe reports the highest request rate whose attainment stays above a target
  (e.g. 90%); a rate sweep gives that figure as `max_rate_meeting_target` (see `runner`).
- Errors by reason: "CODE: reason" with numbers in the reason replaced by N, so that e.g. rejections
  quoting different estimates group together. Rejection rate: RESOURCE_EXHAUSTED / measured requests.
- Prefix hit rate: cached prompt tokens / prompt tokens over requests the router routed (that reported
  cached_prompt_tokens).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from loadtest.records import RequestRecord
from loadtest.stats import Distribution

_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
REJECTED = "RESOURCE_EXHAUSTED"


def reason_key(code: str, reason: str | None) -> str:
    """The bucket an error is counted in: status name and the reason with numbers replaced by N."""
    return f"{code}: {_NUMBER.sub('N', reason or '')}".rstrip(": ")


@dataclass(frozen=True)
class Summary:
    workload: str
    requests_planned: int
    requests_not_issued: int
    requests_warmup: int  # issued before warmup_s: run but not measured
    requests_measured: int
    requests_completed: int
    requests_failed: int
    duration_s: float
    request_throughput_per_s: float | None
    output_token_throughput_per_s: float | None
    goodput_per_s: float | None
    slo_attainment: float | None
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    errors: dict[str, int]
    rejection_rate: float | None
    prompt_tokens: int
    cached_prompt_tokens: int
    prefix_hit_rate: float | None
    slo: dict[str, float | None] = field(default_factory=dict)
    rate_per_s: float | str | None = None  # the sweep point, when a sweep ran
    notes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _errors(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if r.error_code is not None:
            key = reason_key(r.error_code, r.error_reason)
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def summarize(
    records: Sequence[RequestRecord],
    *,
    workload: str,
    planned: int,
    warmup_s: float = 0.0,
    rate_per_s: float | str | None = None,
    notes: dict | None = None,
) -> Summary:
    """The summary of one run; `planned` is the plan's length (not-issued = planned - len(records))."""
    measured = [r for r in records if r.arrival_s >= warmup_s]
    done = [r for r in measured if r.ok]
    duration_s = (max(r.end_s for r in measured) - min(r.send_s for r in measured)) if measured else 0.0
    met = sum(r.met_slo for r in measured)
    routed = [r for r in measured if r.cached_prompt_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens for r in routed)
    cached_tokens = sum(r.cached_prompt_tokens or 0 for r in routed)  # all set: `routed`
    first = measured[0] if measured else None
    return Summary(
        workload=workload,
        requests_planned=planned,
        requests_not_issued=planned - len(records),
        requests_warmup=len(records) - len(measured),
        requests_measured=len(measured),
        requests_completed=len(done),
        requests_failed=len(measured) - len(done),
        duration_s=duration_s,
        request_throughput_per_s=_ratio(len(done), duration_s),
        output_token_throughput_per_s=_ratio(sum(r.output_tokens for r in measured), duration_s),
        goodput_per_s=_ratio(met, duration_s),
        slo_attainment=_ratio(met, len(measured)),
        ttft_ms=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None], 1e3),  # all set when ok
        tpot_ms=Distribution.of([r.tpot_s for r in done if r.tpot_s is not None], 1e3),
        itl_ms=Distribution.of([x for r in done for x in r.itl_s], 1e3),
        e2e_ms=Distribution.of([r.e2e_s for r in done], 1e3),
        errors=_errors(measured),
        rejection_rate=_ratio(sum(r.error_code == REJECTED for r in measured), len(measured)),
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached_tokens,
        prefix_hit_rate=_ratio(cached_tokens, prompt_tokens),
        slo={"ttft_ms": first.ttft_slo_ms if first else None, "tpot_ms": first.tpot_slo_ms if first else None},
        rate_per_s=rate_per_s,
        notes=dict(notes or {}),
    )


def _fmt(value, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{value * 100:.1f}%"
    return f"{value:.{digits}f}{unit}"


def format_table(s: Summary) -> str:
    """A fixed-width table for the terminal."""
    title = f"splitserve bench: {s.workload}" + (f" @ {s.rate_per_s} req/s" if s.rate_per_s is not None else "")
    lines = [
        title,
        "-" * 64,
        f"requests  planned {s.requests_planned}  measured {s.requests_measured}  completed "
        f"{s.requests_completed}  failed {s.requests_failed}  not issued {s.requests_not_issued}"
        + (f"  warm-up {s.requests_warmup}" if s.requests_warmup else ""),
        (
            f"duration {_fmt(s.duration_s, ' s')}  throughput {_fmt(s.request_throughput_per_s, ' req/s')}  "
            f"{_fmt(s.output_token_throughput_per_s, ' tok/s', 1)}"
        ),
        (
            f"SLO (ttft {_fmt(s.slo.get('ttft_ms'), ' ms', 0)}, tpot {_fmt(s.slo.get('tpot_ms'), ' ms', 0)})  "
            f"attainment {_fmt(s.slo_attainment, '%')}  goodput {_fmt(s.goodput_per_s, ' req/s')}"
        ),
        (
            f"prefix hit rate {_fmt(s.prefix_hit_rate, '%')} ({s.cached_prompt_tokens}/{s.prompt_tokens} "
            f"prompt tokens)  rejection rate {_fmt(s.rejection_rate, '%')}"
        ),
        "",
        f"{'latency (ms)':<14}{'mean':>10}{'std':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}{'n':>8}",
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d: Distribution = getattr(s, name)
        cells = "".join(f"{_fmt(v):>10}" for v in (d.mean, d.std, d.p50, d.p90, d.p99, d.max))
        lines.append(f"{name.removesuffix('_ms').upper():<14}{cells}{d.count:>8}")
    if s.notes:  # how the plan was made: trace rows dropped and why, scaling, clipping
        lines += ["", "workload: " + ", ".join(f"{k}={v}" for k, v in s.notes.items())]
    if s.errors:
        lines += ["", "errors by reason:"] + [f"  {n:>6}  {key}" for key, n in s.errors.items()]
    return "\n".join(lines)
