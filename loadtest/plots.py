"""PNG plots with matplotlib's Agg backend (no display needed): latency CDFs, for a rate sweep SLO
attainment and goodput against the offered request rate, and for the admission evaluation both
figures per admission policy against the offered load.

matplotlib is imported on first use, so `splitserve bench` without `--plot` does not need it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from loadtest.records import RequestRecord
from loadtest.summary import Summary

# file stem -> (title, how a completed record gives its value in seconds)
_CDFS = {
    "ttft_cdf": ("Time to first token", lambda r: r.ttft_s),
    "tpot_cdf": ("Time per output token", lambda r: r.tpot_s),
    "e2e_cdf": ("End-to-end latency", lambda r: r.e2e_s),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], out_dir: str | Path) -> list[Path]:
    """One PNG per latency (TTFT, TPOT, E2E) with one empirical CDF per run (label -> records, e.g.
    one label per sweep rate), over completed requests. Returns the files written."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (title, value_s) in _CDFS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, records in runs.items():
            values_ms = sorted(v * 1e3 for r in records if r.ok and (v := value_s(r)) is not None)
            if values_ms:
                fractions = [(i + 1) / len(values_ms) for i in range(len(values_ms))]
                ax.step(values_ms, fractions, where="post", label=f"{label} (n={len(values_ms)})")
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no completed requests", ha="center", transform=ax.transAxes)
        written.append(_save(fig, out / f"{stem}.png", plt))
    return written


def plot_sweep(
    points: Sequence[tuple[float, Summary]], out_dir: str | Path, attainment_target: float | None = None
) -> list[Path]:
    """SLO attainment vs rate and goodput (with request throughput) vs rate, from (rate, summary) pairs."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    points = sorted(points, key=lambda p: p[0])
    rates = [rate for rate, _ in points]

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rates, [_or_zero(s.slo_attainment) * 100 for _, s in points], marker="o", label="SLO attainment")
    if attainment_target is not None:
        ax.axhline(attainment_target * 100, linestyle="--", color="grey", label=f"target {attainment_target:.0%}")
    ax.set(title="SLO attainment vs request rate", xlabel="offered rate (req/s)", ylabel="% of requests", ylim=(0, 102))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    written = [_save(fig, out / "slo_attainment_vs_rate.png", plt)]

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rates, [_or_zero(s.goodput_per_s) for _, s in points], marker="o", label="goodput (met SLO)")
    ax.plot(
        rates,
        [_or_zero(s.request_throughput_per_s) for _, s in points],
        marker="s",
        linestyle=":",
        label="throughput (completed)",
    )
    ax.plot(rates, rates, color="grey", linestyle="--", linewidth=0.8, label="offered")
    ax.set(title="Goodput vs request rate", xlabel="offered rate (req/s)", ylabel="req/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    written.append(_save(fig, out / "goodput_vs_rate.png", plt))
    return written


def plot_policy_comparison(points: Sequence, out_dir: str | Path, saturation_per_s: float) -> list[Path]:
    """Goodput and SLO attainment vs offered load (x saturation), one line per admission policy, from
    `loadtest.admission_report.Point`s."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policies = sorted({p.policy for p in points})
    written = []
    for stem, title, ylabel, value in (
        (
            "admission_goodput_vs_load",
            "Goodput vs offered load",
            "goodput (req/s meeting TTFT and TPOT SLO)",
            lambda p: p.goodput_per_s,
        ),
        (
            "admission_attainment_vs_load",
            "SLO attainment vs offered load",
            "% of requests meeting the SLO",
            lambda p: p.attainment * 100,
        ),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy in policies:
            mine = sorted((p for p in points if p.policy == policy), key=lambda p: p.load)
            ax.plot([p.load for p in mine], [value(p) for p in mine], marker="o", label=f"admission {policy}")
        ax.set(
            title=f"{title} (saturation {saturation_per_s:.2g} req/s)",
            xlabel="offered load (x saturation)",
            ylabel=ylabel,
            ylim=(0, None),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        written.append(_save(fig, out / f"{stem}.png", plt))
    return written


def _or_zero(value: float | None) -> float:
    return 0.0 if value is None else value


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
