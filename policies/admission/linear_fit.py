"""Windowed least squares with non-negative, prior-backed coefficients: the one fitter behind every
admission cost model (`cost_model.py`).

Model: target ≈ Σ_j coef_j · feature_j, fitted over the most recent `window` samples only.

* Windowed, not recursive: a refit over the last N samples forgets an old regime completely after N
  steps (a new model revision, a noisy neighbour gone), while recursive least squares with a
  forgetting factor never forgets entirely and accumulates rounding error. A refit is cheap here
  (N ≈ hundreds, at most 3 terms) and happens lazily, once per batch of new samples, on the next read.
* Non-negative, solved exactly: every term is a physical cost (a fixed overhead, a cost per token or
  per sequence), so the fit is the non-negative least-squares optimum over the terms the window can
  identify. With at most a handful of terms the optimum is found by trying every subset of them as
  the support (2^k small least-squares solves; k is 2 or 3 here): the optimum is the unconstrained
  solution on its own support, so the best non-negative subset solution is exactly it; on a tie
  the subset with fewer terms wins. (The greedy active set this replaced pinned the most negative
  unscaled coefficient, usually the fixed cost, and never let it back in: on prefill windows of long
  prompts — 1,000-2,048 tokens per step, 5% noise — it missed the optimum in 27% of windows, dropping
  the fixed overhead and predicting a 64-token prompt at down to 0.27x its true time;
  `python -m benchmarks.fit_vs_greedy` measures both.)
* Prior-backed: before `min_samples` samples the prior is the whole answer. After that, a term the
  window cannot identify — its feature is zero in every sample, or a combination of the terms before
  it (e.g. every decode step had batch size 1, so "per sequence" and "fixed" cost look the same) —
  keeps its prior value, and the identifiable terms are fitted to what the prior leaves over.
  Identifiability is decided in term order (fixed cost first), so the simplest explanation wins.

Owned by one router and used from its event loop only: no locking.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

import numpy as np

# A term joins the fit only if the column-scaled design keeps its smallest singular value above this
# fraction of the largest: below it the term is indistinguishable from the others in this window.
_RANK_RTOL = 1e-6
# The exact non-negative solve tries all 2^k supports: fine for the 2-3 terms of a cost model.
MAX_TERMS = 6


class WindowedLinearFit:
    def __init__(self, prior: Sequence[float], window: int, min_samples: int):
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window}, {min_samples}")
        if not 1 <= len(prior) <= MAX_TERMS:
            raise ValueError(f"need 1 to {MAX_TERMS} terms (the exact solve tries every subset), got {len(prior)}")
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
        coefficients = np.array(self.prior, dtype=np.float64)  # unidentifiable terms keep the prior
        scale = np.abs(x).max(axis=0)
        # Scaling columns to [−1, 1] keeps tokens² (≈1e8) and the constant 1 comparable for the solves.
        scaled = x / np.where(scale > 0, scale, 1.0)
        free = _identifiable_terms(scaled, scale)
        if free:
            fixed = [j for j in range(len(coefficients)) if j not in free]
            residual = y - x[:, fixed] @ coefficients[fixed]
            coefficients[free] = nonnegative_least_squares(scaled[:, free], residual) / scale[free]
        return tuple(float(c) for c in coefficients)


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a·c − b|| over c >= 0, exactly, for the few linearly independent columns of `a`.

    The optimum is the unconstrained least-squares solution restricted to its own support (the
    residual is orthogonal to every column it uses), so it is the best of the subset solutions that
    come out non-negative. Subsets are tried smallest first and a larger one must lower the squared
    residual by more than rounding, so a tie goes to fewer terms.
    """
    num_terms = a.shape[1]
    best, best_cost = np.zeros(num_terms), float(b @ b)
    tolerance = 1e-12 * max(best_cost, np.finfo(np.float64).tiny)
    for size in range(1, num_terms + 1):
        for support in itertools.combinations(range(num_terms), size):
            columns = list(support)
            solution, *_ = np.linalg.lstsq(a[:, columns], b, rcond=None)
            if np.any(solution < 0):
                continue
            residual = b - a[:, columns] @ solution
            cost = float(residual @ residual)
            if cost < best_cost - tolerance:
                best, best_cost = np.zeros(num_terms), cost
                best[columns] = solution
    return best


def _identifiable_terms(scaled: np.ndarray, scale: np.ndarray) -> list[int]:
    """Terms, in order, that add an independent direction to the ones already chosen."""
    chosen: list[int] = []
    for j in range(scaled.shape[1]):
        if scale[j] == 0:
            continue
        singular = np.linalg.svd(scaled[:, [*chosen, j]], compute_uv=False)
        if len(singular) == len(chosen) + 1 and singular[-1] > _RANK_RTOL * singular[0]:
            chosen.append(j)
    return chosen
