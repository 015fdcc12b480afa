"""Percentiles and the latency distribution summary the bench reports.

Percentiles interpolate linearly between the two nearest ranks of the sorted sample (numpy's default
"linear" method): for n values, percentile q sits at position (n - 1) * q / 100.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of a non-empty sample."""
    if not values:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Distribution:
    """Count, mean, p50 / p90 / p99 and max of a sample, in the unit of its name (e.g. `ttft_ms`), plus
    median (= p50) and the population standard deviation, the two `vllm bench serve` adds.
    An empty sample has count 0 and None elsewhere."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    median: float | None = None
    std: float | None = None

    @staticmethod
    def of(values: Sequence[float], scale: float = 1.0) -> Distribution:
        """The distribution of values x scale (e.g. seconds -> milliseconds with scale=1000)."""
        if not values:
            return Distribution(0, None, None, None, None, None)
        scaled = [v * scale for v in values]
        mean, median = sum(scaled) / len(scaled), percentile(scaled, 50)
        std = math.sqrt(sum((v - mean) ** 2 for v in scaled) / len(scaled))
        return Distribution(
            len(scaled), mean, median, percentile(scaled, 90), percentile(scaled, 99), max(scaled), median, std
        )
