"""Speculative decoding's cumulative counters, per engine: plain data (no torch), so worker stats and
metrics can carry them across process boundaries."""

from __future__ import annotations

from typing import NamedTuple


class SpecCounters(NamedTuple):
    """Verify steps summed over sequences, drafts proposed and accepted, and engine steps (with decoding
    sequences) that ran with speculation switched on / off by the adaptive rule."""

    sequence_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps_on: int = 0
    steps_off: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (0 before any draft)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence emits per verify step: accepted drafts + the target's token (0 before any)."""
        return 1 + self.accepted_tokens / self.sequence_steps if self.sequence_steps else 0.0
