"""Prompt lookup (n-gram) proposals: no second model, drafts come from the sequence's own tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`: take the sequence's last n tokens, find
their most recent earlier occurrence, and propose the tokens that followed it there (up to k). The
longest n that matches wins. Code edits, summaries and extraction repeat their input, so the
continuation of the last match is a good guess; on free text it rarely matches and proposes nothing,
which costs nothing (the sequence decodes as usual that step).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Up to `max_tokens` drafts continuing `token_ids` (possibly none)."""
        if max_tokens <= 0 or len(token_ids) < self.min_n + 1:
            return ()
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _last_earlier_match(tokens, n)
            if start is not None:
                follow = tokens[start + n : start + n + max_tokens]
                if follow.size:
                    return tuple(follow.tolist())
        return ()


def _last_earlier_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest occurrence of the last `n` tokens that ends before the sequence does."""
    suffix = tokens[-n:]
    windows = sliding_window_view(tokens[:-1], n)  # every window ending before the last token
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    return int(hits[-1]) if hits.size else None
