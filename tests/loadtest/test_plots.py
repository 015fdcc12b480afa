"""Plots are written as real, non-empty PNGs (Agg backend), also when a run completed nothing."""
from __future__ import annotations

from loadtest.plots import plot_latency_cdfs, plot_sweep
from loadtest.summary import summarize
from tests.loadtest.test_summary import RECORDS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_latency_cdfs_one_file_per_latency(tmp_path):
    written = plot_latency_cdfs({"1 req/s": RECORDS, "2 req/s": RECORDS[:2], "none": RECORDS[2:4]}, tmp_path / "p")
    assert sorted(p.name for p in written) == ["e2e_cdf.png", "tpot_cdf.png", "ttft_cdf.png"]
    assert all(is_png(p) for p in written)
    empty = plot_latency_cdfs({"rejected": RECORDS[2:4]}, tmp_path / "empty")
    assert all(is_png(p) for p in empty)


def test_sweep_plots(tmp_path):
    points = [(rate, summarize(RECORDS[:k], workload="p", planned=k, rate_per_s=rate))
              for rate, k in ((4.0, 6), (1.0, 1), (2.0, 3))]
    written = plot_sweep(points, tmp_path, attainment_target=0.9)
    assert sorted(p.name for p in written) == ["goodput_vs_rate.png", "slo_attainment_vs_rate.png"]
    assert all(is_png(p) for p in written)
