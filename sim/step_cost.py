"""What one engine step costs: `StepCost`, and fitting one from measured steps.

An engine step (engine/llm_engine.py) computes a flat batch of tokens: one per decoding sequence and a
chunk of each prefilling one. Its time is modelled as

    step_s = dense(T) + per_seq_s * n + prefill_pair_s * P + decode_context_s * C + prefill_step_s * [P > 0]

- T: tokens computed (every linear layer runs over them; `dense` is piecewise linear through measured
  knots, so the memory-bound small batches and the compute-bound large ones are both right);
- n: sequences in the batch (sampling, one attention call per prefill chunk, bookkeeping);
- P: causal attention pairs of the prefill chunks, sum of new * (start + (new + 1) / 2) over chunks
  that compute `new` tokens after `start` cached/computed ones;
- C: KV tokens the decode rows read, the sum of each decoding sequence's length;
- [P > 0]: the step computes a prompt chunk. On a GPU a decode-only step replays a captured CUDA graph
  while a step with a prompt chunk runs eagerly, launch by launch: measured on an H200 with a 1B model,
  1.7 ms for a batch-1 decode step and ~10 ms for any chunk up to 2,048 tokens, a difference dense(T)
  alone cannot hold at the T both kinds of step reach (the fit's RMS error was 30% without this term).
  On CPU both kinds run eagerly and the term fits near 0.

Every term is linear in its coefficients, so a measured profile is a non-negative least-squares fit
(`fit_step_cost`), and a roofline profile writes the same coefficients from a GPU's datasheet. Within
a run of identical steps, P grows by sum(new^2) and C by the batch size per step, so step times form
an arithmetic progression: the simulator advances whole runs in closed form.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class StepSample(NamedTuple):
    """One measured step: its shape and how long it took."""

    tokens: int
    seqs: int
    prefill_pairs: float
    decode_context: int
    duration_s: float


@dataclass(frozen=True)
class StepCost:
    knots_tokens: tuple[int, ...]  # increasing, first >= 1
    dense_s: tuple[float, ...]  # dense(T) at each knot; linear between, extrapolated past the last
    per_seq_s: float = 0.0
    prefill_pair_s: float = 0.0
    decode_context_s: float = 0.0
    prefill_step_s: float = 0.0  # once per step that computes a prompt chunk

    def __post_init__(self):
        if len(self.knots_tokens) < 2 or len(self.knots_tokens) != len(self.dense_s):
            raise ValueError("a step cost needs >= 2 knots and one dense time per knot")
        if list(self.knots_tokens) != sorted(set(self.knots_tokens)) or self.knots_tokens[0] < 1:
            raise ValueError(f"knots must be increasing integers >= 1, got {self.knots_tokens}")
        values = (*self.dense_s, self.per_seq_s, self.prefill_pair_s, self.decode_context_s, self.prefill_step_s)
        if not all(v >= 0 and np.isfinite(v) for v in values):
            raise ValueError("step cost coefficients must be finite and >= 0")

    def dense(self, tokens: float) -> float:
        knots, values = self.knots_tokens, self.dense_s
        i = min(max(bisect.bisect_right(knots, tokens) - 1, 0), len(knots) - 2)
        slope = (values[i + 1] - values[i]) / (knots[i + 1] - knots[i])
        return max(values[i] + slope * (tokens - knots[i]), 0.0)

    def seconds(self, tokens: int, seqs: int, prefill_pairs: float = 0.0, decode_context: int = 0) -> float:
        if tokens <= 0:
            return 0.0
        return (
            self.dense(tokens)
            + self.per_seq_s * seqs
            + self.prefill_pair_s * prefill_pairs
            + self.decode_context_s * decode_context
            + (self.prefill_step_s if prefill_pairs > 0 else 0.0)
        )

    def scaled(self, factor: float) -> StepCost:
        """Every step `factor` times as long (an engine slower in its cluster worker than profiled)."""
        if factor == 1.0:
            return self
        return StepCost(
            self.knots_tokens,
            tuple(v * factor for v in self.dense_s),
            self.per_seq_s * factor,
            self.prefill_pair_s * factor,
            self.decode_context_s * factor,
            self.prefill_step_s * factor,
        )

    def plus_step_s(self, extra_s: float) -> StepCost:
        """The same cost with `extra_s` more on every step (a cluster worker's own per-step overhead)."""
        return (
            StepCost(
                self.knots_tokens,
                tuple(v + extra_s for v in self.dense_s),
                self.per_seq_s,
                self.prefill_pair_s,
                self.decode_context_s,
                self.prefill_step_s,
            )
            if extra_s
            else self
        )

    def to_dict(self) -> dict:
        return {
            "knots_tokens": list(self.knots_tokens),
            "dense_ms": [v * 1e3 for v in self.dense_s],
            "per_seq_ms": self.per_seq_s * 1e3,
            "prefill_pair_ns": self.prefill_pair_s * 1e9,
            "decode_context_ns": self.decode_context_s * 1e9,
            "prefill_step_ms": self.prefill_step_s * 1e3,
        }

    @staticmethod
    def from_dict(raw: dict, where: str) -> StepCost:
        try:
            return StepCost(
                tuple(int(k) for k in raw["knots_tokens"]),
                tuple(v / 1e3 for v in raw["dense_ms"]),
                raw["per_seq_ms"] / 1e3,
                raw["prefill_pair_ns"] / 1e9,
                raw["decode_context_ns"] / 1e9,
                raw.get("prefill_step_ms", 0.0) / 1e3,  # absent from profiles written before the term
            )
        except KeyError as err:
            raise ValueError(f"{where}: missing key {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None


_LINEAR_TERMS = 4  # per_seq, prefill_pair, decode_context, prefill_step


def prefill_pairs(start: int, new: int) -> float:
    """Causal attention pairs of a chunk of `new` tokens after `start` earlier ones."""
    return new * (start + (new + 1) / 2)


def fit_step_cost(samples: Iterable[StepSample], knots_tokens: tuple[int, ...]) -> tuple[StepCost, float]:
    """The non-negative least-squares fit of the model to the samples, weighted so that every sample's
    relative error counts alike; returns the cost and the fit's RMS relative error.

    dense(T) is fitted as non-negative increments from knot to knot, so it never falls as T grows: more
    tokens never cost less, however noisy the timer (a free fit of the knot values could dip there)."""
    samples = list(samples)
    if len(samples) < len(knots_tokens) + _LINEAR_TERMS:
        raise ValueError(f"{len(samples)} samples cannot fit {len(knots_tokens) + _LINEAR_TERMS} coefficients")
    design = np.array([_row(s, knots_tokens) for s in samples])
    target = np.array([s.duration_s for s in samples])
    weights = 1.0 / target
    coef = nnls(design * weights[:, None], target * weights)
    k = len(knots_tokens)
    dense_s = np.cumsum(coef[:k])
    cost = StepCost(knots_tokens, tuple(float(v) for v in dense_s), *(float(v) for v in coef[k:]))
    predicted = np.array([cost.seconds(s.tokens, s.seqs, s.prefill_pairs, s.decode_context) for s in samples])
    return cost, float(np.sqrt(np.mean(((predicted - target) / target) ** 2)))


def _row(sample: StepSample, knots: tuple[int, ...]) -> list[float]:
    """Basis of dense(T) in knot-to-knot increments (increment j counts wherever knot j or a later one
    weighs in: the suffix sums of the hat functions around T), then the linear terms."""
    hats = [0.0] * len(knots)
    t = sample.tokens
    i = min(max(bisect.bisect_right(knots, t) - 1, 0), len(knots) - 2)
    w = (t - knots[i]) / (knots[i + 1] - knots[i])
    hats[i], hats[i + 1] = 1.0 - w, w
    increments = np.cumsum(hats[::-1])[::-1]
    prefill_step = 1.0 if sample.prefill_pairs > 0 else 0.0
    return [*increments.tolist(), sample.seqs, sample.prefill_pairs, sample.decode_context, prefill_step]


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method). Columns are scaled
    to unit norm first so that coefficients of very different magnitudes converge alike."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    n = a.shape[1]
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        gradient = a.T @ (b - a @ x)
        candidates = ~passive & (gradient > 1e-12)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            shrinking = passive & (z <= 0)
            alpha = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x / scale
