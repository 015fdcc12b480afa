"""The fit comparison runs and reports what the README and linear_fit's docstring quote (few windows)."""
from __future__ import annotations

import argparse

from benchmarks.fit_vs_greedy import run


def test_the_greedy_baseline_misses_where_the_exact_fit_does_not():
    args = argparse.Namespace(windows=120, steps=64, noise=0.05, min_tokens=1000, max_tokens=2048, short_tokens=64,
                              seed=0)
    result = run(args)
    assert result["greedy_missed_share"] > 0.1  # ~28% over 1,000 windows
    assert result["short_prompt_ratio_min"]["greedy"] < 0.5 < result["short_prompt_ratio_min"]["exact"]
