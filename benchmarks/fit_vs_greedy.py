"""The admission fit (`policies/admission/linear_fit.py`, exact non-negative least squares) against the
greedy active set it replaced, on prefill-like windows: how often each misses the optimum, and what
each predicts for a short prompt. Numbers only, no cluster:

    .venv/bin/python -m benchmarks.fit_vs_greedy [--windows 1000] [--noise 0.05] [--steps 64]

Windows: a prefill worker busy with long prompts (`--min-tokens`..`--max-tokens` per step), step time
= 10 ms + 50 µs/token times lognormal noise; the fit's prior is the cost model's (PREFILL_PRIOR).
"""

from __future__ import annotations

import argparse

import numpy as np

from policies.admission.cost_model import PREFILL_PRIOR, PrefillTimeFit
from policies.admission.linear_fit import WindowedLinearFit, _identifiable_terms

TRUTH = PrefillTimeFit(intercept_s=0.010, per_token_s=5e-5, per_token_sq_s=0.0)


def greedy(x: np.ndarray, y: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """The replaced solver: pin the most negative unscaled coefficient to 0, refit the rest, never
    let a pinned term back in."""
    scale = np.abs(x).max(axis=0)
    scaled = x / np.where(scale > 0, scale, 1.0)
    free = _identifiable_terms(scaled, scale)
    coefficients = prior.copy()
    while free:
        fixed = [j for j in range(len(prior)) if j not in free]
        solution, *_ = np.linalg.lstsq(scaled[:, free], y - x[:, fixed] @ coefficients[fixed], rcond=None)
        solution = solution / scale[free]
        worst = int(np.argmin(solution))
        if solution[worst] >= 0:
            coefficients[free] = solution
            break
        coefficients[free.pop(worst)] = 0.0
    return coefficients


def _cost(x: np.ndarray, y: np.ndarray, c) -> float:
    residual = y - x @ np.asarray(c)
    return float(residual @ residual)


def run(args) -> dict:
    rng = np.random.default_rng(args.seed)
    prior = np.array(PREFILL_PRIOR, dtype=np.float64)
    missed, ratios_exact, ratios_greedy = 0, [], []
    for _ in range(args.windows):
        tokens = rng.integers(args.min_tokens, args.max_tokens + 1, args.steps).astype(np.float64)
        y = (TRUTH.intercept_s + TRUTH.per_token_s * tokens) * rng.lognormal(0, args.noise, args.steps)
        x = np.stack([np.ones_like(tokens), tokens, tokens**2], axis=1)
        fit = WindowedLinearFit(tuple(prior), window=args.steps, min_samples=1)
        for features, target in zip(x, y, strict=True):
            fit.add(tuple(features), float(target))
        exact, old = np.array(fit.coefficients()), greedy(x, y, prior)
        missed += _cost(x, y, old) > _cost(x, y, exact) * (1 + 1e-9)
        truth = TRUTH.time_s(args.short_tokens)
        ratios_exact.append(PrefillTimeFit(*exact).time_s(args.short_tokens) / truth)
        ratios_greedy.append(PrefillTimeFit(*old).time_s(args.short_tokens) / truth)
    return {
        "windows": args.windows,
        "greedy_missed_share": missed / args.windows,
        "short_prompt_ratio_min": {"exact": min(ratios_exact), "greedy": min(ratios_greedy)},
        "short_prompt_within_10pct": {
            "exact": float(np.mean(np.abs(np.array(ratios_exact) - 1) <= 0.1)),
            "greedy": float(np.mean(np.abs(np.array(ratios_greedy) - 1) <= 0.1)),
        },
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=1000)
    p.add_argument("--steps", type=int, default=64, help="samples per window")
    p.add_argument("--noise", type=float, default=0.05, help="lognormal sigma of step times")
    p.add_argument("--min-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--short-tokens", type=int, default=64, help="the short prompt predicted")
    p.add_argument("--seed", type=int, default=0)
    result = run(p.parse_args(argv))
    print(
        f"{result['windows']} windows: the greedy active set missed the optimum in "
        f"{result['greedy_missed_share']:.1%} (the exact fit in none, by construction)"
    )
    for name in ("exact", "greedy"):
        print(f"  {name:>6}: {args_short(result, name)}")


def args_short(result: dict, name: str) -> str:
    return (
        f"short prompt predicted/true min {result['short_prompt_ratio_min'][name]:.2f}, "
        f"within 10% in {result['short_prompt_within_10pct'][name]:.1%} of windows"
    )


if __name__ == "__main__":
    main()
