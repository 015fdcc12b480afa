"""Open-loop arrival times of a Poisson process.

The first request is due at 0 and gaps are i.i.d. exponential with mean 1 / rate. Gaps are drawn as
standard exponentials and then divided by the rate, so the same seed at another rate gives the same
pattern stretched in time: a rate sweep compares like with like. An infinite rate puts every request
at 0 (a burst; the concurrency cap then paces it).
"""

from __future__ import annotations

import math

import numpy as np


def poisson_arrivals_s(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    """n non-decreasing arrival offsets in seconds, starting at 0."""
    if not rate_per_s > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate_per_s}")
    gaps = rng.standard_exponential(max(n - 1, 0))
    if math.isinf(rate_per_s):
        return np.zeros(n)
    return np.concatenate([[0.0], np.cumsum(gaps / rate_per_s)])[:n]
