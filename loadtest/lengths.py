"""Token-length distributions (`fixed:N`, `uniform:LO,HI`, `lognormal:MEAN,SIGMA`) and fitting lengths
into the model's context.

`lognormal:MEAN,SIGMA` is parameterised by the distribution's own mean in tokens (not the log-space
mean) and the log-space sigma: mu = ln(MEAN) - SIGMA^2 / 2, so that changing SIGMA changes the spread
and tail but keeps the average load. Samples are rounded to integers and are at least 1; `fit_lengths`
then clips them to the model's limits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def _fixed(rng: np.random.Generator, n: int, params: tuple[float, ...]) -> np.ndarray:
    return np.full(n, params[0])


def _uniform(rng: np.random.Generator, n: int, params: tuple[float, ...]) -> np.ndarray:
    return rng.integers(int(params[0]), int(params[1]), size=n, endpoint=True)


def _lognormal(rng: np.random.Generator, n: int, params: tuple[float, ...]) -> np.ndarray:
    mean, sigma = params
    return rng.lognormal(math.log(mean) - sigma * sigma / 2.0, sigma, size=n)


# kind -> (parameter names, sampler)
_KINDS: dict[str, tuple[tuple[str, ...], Callable]] = {
    "fixed": (("N",), _fixed),
    "uniform": (("LO", "HI"), _uniform),
    "lognormal": (("MEAN", "SIGMA"), _lognormal),
}


def _syntax() -> str:
    return ", ".join(f"{kind}:{','.join(names)}" for kind, (names, _) in _KINDS.items())


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts; `parse` builds one from its CLI spelling."""

    kind: str
    params: tuple[float, ...]

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"unknown length distribution {self.kind!r}; known: {_syntax()}")
        names = _KINDS[self.kind][0]
        if len(self.params) != len(names):
            raise ValueError(f"{self.kind} takes {len(names)} value(s): {self.kind}:{','.join(names)}")
        if self.kind in ("fixed", "uniform") and any(p != int(p) or p < 1 for p in self.params):
            raise ValueError(f"{self.kind} lengths must be integers >= 1, got {self.spelling}")
        if self.kind == "uniform" and self.params[0] > self.params[1]:
            raise ValueError(f"uniform needs LO <= HI, got {self.spelling}")
        if self.kind == "lognormal" and not (self.params[0] >= 1 and 0 <= self.params[1] <= 4):
            raise ValueError(f"lognormal needs MEAN >= 1 and SIGMA in [0, 4], got {self.spelling}")

    @property
    def spelling(self) -> str:
        return f"{self.kind}:{','.join(f'{p:g}' for p in self.params)}"

    @staticmethod
    def parse(text: str) -> LengthDist:
        """'fixed:128' / 'uniform:64,256' / 'lognormal:200,0.8' -> LengthDist; ValueError otherwise."""
        kind, sep, rest = text.strip().partition(":")
        if not sep or not rest:
            raise ValueError(f"length distribution {text!r} must be one of {_syntax()}")
        try:
            params = tuple(float(v) for v in rest.split(","))
        except ValueError:
            raise ValueError(f"length distribution {text!r}: values must be numbers ({_syntax()})") from None
        if not all(math.isfinite(p) for p in params):
            raise ValueError(f"length distribution {text!r}: values must be finite")
        return LengthDist(kind, params)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n lengths (int64, each >= 1), drawn from rng."""
        raw = _KINDS[self.kind][1](rng, n, self.params)
        return np.maximum(np.rint(raw), 1).astype(np.int64)


def fit_lengths(prompt_lens: np.ndarray, output_lens: np.ndarray, max_model_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Clips prompts to [1, max_model_len - 1] (room for one output token), then outputs to
    [1, max_model_len - prompt]."""
    prompts = np.clip(prompt_lens, 1, max_model_len - 1)
    outputs = np.clip(output_lens, 1, max_model_len - prompts)
    return prompts.astype(np.int64), outputs.astype(np.int64)
