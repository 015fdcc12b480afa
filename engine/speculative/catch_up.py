"""What a draft model's catch-up steps cost speculation, per token it yields (the adaptive switch's input).

A catch-up step is a speculative step in which the draft computed KV it lacked: a new prompt's, or the
tokens decoded while the switch had speculation off. Plain decoding never pays it, so it is a cost of
speculating (engine/speculative/adaptive.py). Two rules price it:

1. **Amortised over the tokens it enables.** A sequence's draft KV is caught up once per prompt (and
   once per off period); every speculative step after it is level. So a catch-up's cost per token is
   its time beyond a level speculative step, over the tokens the caught-up sequences are still expected
   to produce (`tokens_ahead`: the decoder's estimate from their max_tokens and the output lengths of
   recently finished requests), added to the level cost of every token (`surcharge_s`), not over the
   few tokens of the speculative steps the switch's window happens to hold. Where the tokens ahead are
   not known the step enters the window at its full cost, as before this rule.
   Measured on an H200 (bf16, a 2-layer draft accepting 97%, 128-token outputs): a batch-1 catch-up of
   ~150 tokens took ~11 ms, 17 plain steps. Judged over the three speculative steps of a probe it read
   1.5x dearer per token than plain decoding, and the switch kept off a draft that forced runs 1.85x
   faster; spread over the request's 128 tokens it adds ~0.07 ms to a level 0.36 ms per token.
2. **A stalled catch-up is charged what its tokens usually cost.** Its rate is its time beyond the level
   step per token caught up; past `STALL_FACTOR` times the median rate of the bucket's last
   `CATCH_UP_RATES` catch-ups (each re-rated against the current level step) it is a stall, charged the
   level step plus the median rate per token; the history keeps the bounded rate, so catch-ups that
   stay dearer move the median within a few steps. Measured on an H200 (bf16): one batch-1 catch-up at
   a new prompt length took 48 ms (cuDNN planning attention for the new shape, since kept out of
   prefill: engine/attention.py) where similar ones took ~3 ms; charged in full it kept the draft off
   for the next 2,048 steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import NamedTuple

CATCH_UP_RATES = 8
STALL_FACTOR = 4.0


class _CatchUp(NamedTuple):
    rated_s: float  # what the stall rule's history keeps (a stall's bounded at STALL_FACTOR x usual)
    charged_s: float  # what speculation is charged for it
    tokens: int  # draft KV tokens computed
    tokens_ahead: int  # tokens the caught-up sequences were expected to produce after it (0: unknown)


class CatchUps:
    """One batch-size bucket's recent catch-up steps."""

    def __init__(self) -> None:
        self._recent: deque[_CatchUp] = deque(maxlen=CATCH_UP_RATES)

    def charge(self, duration_s: float, tokens: int, tokens_ahead: int, level_s: float) -> float:
        """Records a catch-up step of `duration_s` that computed `tokens` of draft KV; returns what it is
        charged (rule 2). `level_s`: a level speculative step's seconds in the bucket (0: none yet)."""
        if tokens <= 0:
            return duration_s
        charged_s = rated_s = duration_s
        if self._recent:
            usual = statistics.median(max(c.rated_s - level_s, 0.0) / c.tokens for c in self._recent)
            if max(duration_s - level_s, 0.0) / tokens > STALL_FACTOR * usual:
                charged_s = level_s + usual * tokens
                rated_s = level_s + STALL_FACTOR * usual * tokens
        self._recent.append(_CatchUp(rated_s, charged_s, tokens, tokens_ahead))
        return charged_s

    def surcharge_s(self, level_s: float) -> float | None:
        """Seconds each speculative token carries for the catch-ups that enabled it (rule 1), over the
        recent catch-ups whose tokens ahead were known; None when there are none."""
        known = [c for c in self._recent if c.tokens_ahead > 0]
        if not known:
            return None
        return sum(max(c.charged_s - level_s, 0.0) for c in known) / sum(c.tokens_ahead for c in known)
