"""`benchmarks.bench_tpot`'s SLO figures on hand-made timings (no engine, no cluster)."""
from __future__ import annotations

import pytest

from benchmarks.bench_tpot import Timing, slo_report


def test_ttft_goodput_and_attainment_count_every_request():
    timings = [
        Timing(0.0, (0.1, 0.15, 0.2), True),  # TTFT 100 ms, TPOT 50 ms: meets 200 / 60
        Timing(0.0, (0.1, 0.3, 0.5), True),  # TPOT 200 ms: misses
        Timing(1.0, (1.5,), False),  # one token: TTFT 500 ms only, misses the 200 ms TTFT SLO
        Timing(1.0, (1.15,), False),  # meets; the run spans 0 .. 2.0 s
        Timing(1.5, (1.6, 2.0), True),  # TTFT 100 ms, TPOT 400 ms: misses
    ]
    got = slo_report(timings, ttft_slo_ms=200.0, tpot_slo_ms=60.0)
    assert got["num_requests"] == 5
    assert got["slo_attainment"] == pytest.approx(2 / 5)
    assert got["goodput_per_s"] == pytest.approx(2 / 2.0)
    assert got["ttft_p50_ms"] == pytest.approx(100.0) and got["ttft_p99_ms"] == pytest.approx(500.0)
