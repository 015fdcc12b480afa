"""Deterministic synthetic token ids: the block for (stream, key) is a pure function of the seed.

Token j of block (stream, key) is `ordinary[x % len(ordinary)]` with x the splitmix64 finalizer chained
over (seed, salt, stream, key, j) in uint64 arithmetic, where `ordinary` is the vocabulary less the EOS
ids. So equal keys give equal tokens in every process and run (no Python `hash()`, no global RNG), a
block's first n tokens do not depend on how long it is, and distinct streams never collide by design.
Vectorised in numpy: a trace's hundred thousand blocks take milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loadtest.plan import ModelLimits

# One stream per use, so that e.g. a Poisson prompt never equals a trace block with the same key.
POISSON_PROMPT = 1
SHARED_PREFIX = 2
SHARED_SUFFIX = 3
TRACE_BLOCK = 4
TRACE_PROMPT = 5

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (a bijection on uint64 with good avalanche)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class TokenSource:
    """Blocks of token ids for one model, seed and salt (the salt gives a sweep's points fresh prompts
    with the same lengths and arrivals)."""

    def __init__(self, limits: ModelLimits, seed: int, salt: int = 0):
        self._ordinary = np.asarray(limits.ordinary_token_ids, dtype=np.int64)
        with np.errstate(over="ignore"):
            root = _mix(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) + _GOLDEN)
            self._root = _mix(root ^ (np.uint64(salt & 0xFFFFFFFFFFFFFFFF) * _GOLDEN))

    def blocks(self, stream: int, keys: Sequence[int] | np.ndarray, length: int) -> np.ndarray:
        """A (len(keys), length) int64 array: row i is block (stream, keys[i]). Keys are ints >= 0."""
        key_arr = np.asarray(keys, dtype=np.uint64).reshape(-1, 1)
        positions = np.arange(1, length + 1, dtype=np.uint64).reshape(1, -1)
        with np.errstate(over="ignore"):
            base = _mix(_mix(self._root ^ (np.uint64(stream) * _GOLDEN)) ^ key_arr)
            x = _mix(base + positions * _GOLDEN)
        return self._ordinary[(x % np.uint64(len(self._ordinary))).astype(np.int64)]

    def block(self, stream: int, key: int, length: int) -> tuple[int, ...]:
        """Block (stream, key) as a tuple of Python ints."""
        return tuple(self.blocks(stream, [key], length)[0].tolist())
