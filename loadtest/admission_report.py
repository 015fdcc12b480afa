"""The pure half of the admission evaluation (`benchmarks.eval_admission`): where goodput saturates, the
issue's targets, and the table. No cluster, no clock: tests feed it synthetic points.

Definitions:
- saturation rate: the offered rate at which goodput stops growing under `always` — walking the rates
  up, the first rate whose goodput is not at least `min_gain` (relative) above the best goodput before
  it ends the climb, and the saturation rate is the rate of that best goodput.
- load: offered rate / saturation rate.
- targets: at the highest load swept (3x saturation), `predictive` keeps >= 80% of its own
  peak goodput, and has >= 3x the goodput of `always` there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

KEEP_SHARE_TARGET = 0.8  # predictive's goodput at the highest load / its peak
VS_ALWAYS_TARGET = 3.0  # predictive's goodput / always's, at the highest load


@dataclass(frozen=True)
class Point:
    policy: str
    rate_per_s: float
    load: float  # rate_per_s / the saturation rate
    goodput_per_s: float
    attainment: float  # share of measured requests meeting both SLOs
    rejection_rate: float
    throughput_per_s: float  # completed requests per second, met or not
    ttft_p99_ms: float | None
    failed: int = 0  # measured requests that ended neither completed nor rejected by admission

    def to_dict(self) -> dict:
        return asdict(self)


def saturation_rate(points: Sequence[tuple[float, float]], min_gain: float = 0.1) -> float | None:
    """The rate where goodput stops growing, from (rate, goodput) pairs; None while it still grows."""
    best_rate, best_goodput = None, 0.0
    for rate, goodput in sorted(points):
        if best_rate is not None and goodput < best_goodput * (1.0 + min_gain):
            return best_rate
        if goodput >= best_goodput:
            best_rate, best_goodput = rate, goodput
    return None


def targets(points: Sequence[Point]) -> dict:
    """The two target figures at the highest load swept, and whether each target is met."""
    top_load = max(p.load for p in points)
    at_top = {p.policy: p for p in points if p.load == top_load}
    peak = max(p.goodput_per_s for p in points if p.policy == "predictive")
    predictive, always = at_top["predictive"].goodput_per_s, at_top["always"].goodput_per_s
    keep = predictive / peak if peak > 0 else 0.0
    vs_always = predictive / always if always > 0 else float("inf") if predictive > 0 else 0.0
    return {
        "load": top_load,
        "predictive_peak_goodput_per_s": peak,
        "predictive_goodput_per_s": predictive,
        "always_goodput_per_s": always,
        "keep_share": keep,
        "keep_share_met": keep >= KEEP_SHARE_TARGET,
        "vs_always": vs_always,
        "vs_always_met": vs_always >= VS_ALWAYS_TARGET,
    }


def format_table(points: Sequence[Point]) -> str:
    """One row per (load, policy), loads ascending, `always` first."""
    header = (
        f"{'load':>5} {'rate/s':>7} {'policy':>10} {'goodput/s':>9} {'attain':>7} {'reject':>7} "
        f"{'done/s':>7} {'TTFT p99 ms':>11} {'failed':>6}"
    )
    rows = [header]
    for p in sorted(points, key=lambda p: (p.load, p.policy != "always")):
        ttft = "-" if p.ttft_p99_ms is None else f"{p.ttft_p99_ms:.0f}"
        rows.append(
            f"{p.load:5.2f} {p.rate_per_s:7.2f} {p.policy:>10} {p.goodput_per_s:9.2f} "
            f"{p.attainment:7.0%} {p.rejection_rate:7.0%} {p.throughput_per_s:7.2f} {ttft:>11} {p.failed:6d}"
        )
    return "\n".join(rows)


def format_targets(result: dict) -> str:
    def verdict(met: bool) -> str:
        return "met" if met else "NOT met"

    return (
        f"at {result['load']:.1f}x saturation: predictive keeps {result['keep_share']:.0%} of its peak goodput "
        f"({result['predictive_goodput_per_s']:.2f} of {result['predictive_peak_goodput_per_s']:.2f} req/s; "
        f"target >= {KEEP_SHARE_TARGET:.0%}: {verdict(result['keep_share_met'])}) and has "
        f"{result['vs_always']:.1f}x the goodput of always ({result['always_goodput_per_s']:.2f} req/s; "
        f"target >= {VS_ALWAYS_TARGET:g}x: {verdict(result['vs_always_met'])})"
    )
