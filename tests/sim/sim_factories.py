"""Tiny hand-checkable profiles for the simulator tests.

`linear_profile()`: dense(T) = 1 ms + 0.01 ms * T exactly (two knots), no other step cost unless
asked, a KV hand-off of 5 ms + 1 us per token (1000 bytes per token at 1e9 bytes/s ... see below),
no cluster overheads. Every figure a test asserts follows from these by hand.
"""
from __future__ import annotations

from sim.profile import ModelFacts, Overheads, Profile, Transfer
from sim.step_cost import StepCost

BASE_S = 0.001  # dense(0) extrapolated: the fixed cost of a step
PER_TOKEN_S = 0.00001  # dense slope


def linear_cost(per_seq_s: float = 0.0, prefill_pair_s: float = 0.0, decode_context_s: float = 0.0) -> StepCost:
    return StepCost((1, 1001), (BASE_S + PER_TOKEN_S, BASE_S + 1001 * PER_TOKEN_S), per_seq_s, prefill_pair_s,
                    decode_context_s)


def linear_profile(*, kv_tokens: int = 100_000, tp_cost: dict | None = None, overheads: Overheads = Overheads(),
                   **cost) -> Profile:
    """Transfer: 5 ms + kv_bytes (1000 per token) / 1e8 bytes/s = 5 ms + 0.01 ms per token."""
    steps = {1: linear_cost(**cost), **(tp_cost or {})}
    model = ModelFacts("tiny", 1000, 1000, 4096, 100, 16, (0,))
    return Profile("measured", "test profile", "test", model, steps, {tp: kv_tokens for tp in steps},
                   Transfer(0.005, 1e8), overheads)


def dense_s(tokens: int) -> float:
    return BASE_S + PER_TOKEN_S * tokens


def transfer_s(tokens: int) -> float:
    return 0.005 + tokens * 1000 / 1e8
