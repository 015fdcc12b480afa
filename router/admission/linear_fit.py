"""Windowed least squares with non-negative, prior-backed coefficients: the one fitter behind every
admission cost model (`cost_model.py`).

Model: target ≈ Σ_j coef_j · feature_j, fitted over the most recent `window` samples only.

* Windowed, not recursive: a refit over the last N samples forgets an old regime completely after N
  steps (a new model revision, a noisy neighbour gone), while recursive least squares with a
  forgetting factor never forgets entirely and accumulates rounding error. A refit is cheap here
  (N ≈ hundreds, at most 3 terms) and happens lazily, once per batch of new samples, on the next read.
* Non-negative: every term is a physical cost (a fixed overhead, a cost per token or per sequence).
  A negative estimate says the term is about zero here (plus noise) and would predict negative time
  for some inputs: the most negative term is pinned to 0 and the others refitted, until none is
  negative (an active-set step of non-negative least squares).
* Prior-backed: before `min_samples` samples the prior is the whole answer. After that, a term the
  window cannot identify — its feature is zero in every sample, or a combination of the terms before
  it (e.g. every decode step had batch size 1, so "per sequence" and "fixed" cost look the same) —
  keeps its prior value, and the identifiable terms are fitted to what the prior leaves over.
  Identifiability is decided in term order (fixed cost first), so the simplest explanation wins.

Owned by one router and used from its event loop only: no locking.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

# A term joins the fit only if the column-scaled design keeps its smallest singular value above this
# fraction of the largest: below it the term is indistinguishable from the others in this window.
_RANK_RTOL = 1e-6


class WindowedLinearFit:
    def __init__(self, prior: Sequence[float], window: int, min_samples: int):
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
        if any(not np.isfinite(p) or p < 0 for p in prior):
            raise ValueError(f"prior coefficients must be finite and >= 0, got {tuple(prior)}")
        self.prior = tuple(float(p) for p in prior)
        self.min_samples = min_samples
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._coefficients: tuple[float, ...] | None = self.prior

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def add(self, features: Sequence[float], target: float) -> None:
        if len(features) != len(self.prior):
            raise ValueError(f"expected {len(self.prior)} features, got {len(features)}")
        self._samples.append((tuple(float(f) for f in features), float(target)))
        self._coefficients = None  # refitted on the next read, so a burst of samples costs one fit

    def coefficients(self) -> tuple[float, ...]:
        if self._coefficients is None:
            self._coefficients = self._solve()
        return self._coefficients

    def check_integrity(self) -> None:
        assert len(self._samples) <= (self._samples.maxlen or 0)
        assert all(len(f) == len(self.prior) for f, _ in self._samples)
        coefficients = self.coefficients()
        assert len(coefficients) == len(self.prior) and all(c >= 0 for c in coefficients), coefficients

    def _solve(self) -> tuple[float, ...]:
        if len(self._samples) < self.min_samples:
            return self.prior
        x = np.array([f for f, _ in self._samples], dtype=np.float64)
        y = np.array([t for _, t in self._samples], dtype=np.float64)
        prior = np.array(self.prior, dtype=np.float64)
        scale = np.abs(x).max(axis=0)
        # Scaling columns to [−1, 1] keeps tokens² (≈1e8) and the constant 1 comparable for the SVD.
        scaled = x / np.where(scale > 0, scale, 1.0)
        free = _identifiable_terms(scaled, scale)
        coefficients = prior.copy()  # unidentifiable terms keep the prior
        while free:
            fixed = [j for j in range(len(prior)) if j not in free]
            residual = y - x[:, fixed] @ coefficients[fixed]
            solution, *_ = np.linalg.lstsq(scaled[:, free], residual, rcond=None)
            solution = solution / scale[free]
            worst = int(np.argmin(solution))
            if solution[worst] >= 0:
                coefficients[free] = solution
                break
            coefficients[free.pop(worst)] = 0.0
        return tuple(float(c) for c in coefficients)


def _identifiable_terms(scaled: np.ndarray, scale: np.ndarray) -> list[int]:
    """Terms, in order, that add an independent direction to the ones already chosen."""
    chosen: list[int] = []
    for j in range(scaled.shape[1]):
        if scale[j] == 0:
            continue
        singular = np.linalg.svd(scaled[:, chosen + [j]], compute_uv=False)
        if len(singular) == len(chosen) + 1 and singular[-1] > _RANK_RTOL * singular[0]:
            chosen.append(j)
    return chosen
