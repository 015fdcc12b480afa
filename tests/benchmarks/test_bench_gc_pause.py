"""bench_gc_pause runs end to end and reports a shorter full collection once the heap is frozen."""

from __future__ import annotations

import gc
import re

from benchmarks import bench_gc_pause


def test_the_benchmark_reports_both_pauses(capsys):
    try:
        bench_gc_pause.main(["--repeats", "1"])
    finally:
        gc.unfreeze()
    out = capsys.readouterr().out
    before = float(re.search(r"full collection: ([0-9.]+) ms", out).group(1))
    after_us = float(re.search(r"objects: ([0-9.]+) us", out).group(1))
    assert after_us / 1e3 < before
