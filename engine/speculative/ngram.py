"""Prompt lookup (n-gram) proposals: no second model, drafts come from the sequence's own tokens.

For n from `prompt_lookup_max` down to `prompt_lookup_min`: take the sequence's last n tokens, find
their most recent earlier occurrence, and propose the tokens that followed it there (up to k). The
longest n that matches wins. Code edits, summaries and extraction repeat their input, so the
continuation of the last match is a good guess; on free text it rarely matches and proposes nothing,
which costs nothing (the sequence decodes as usual that step).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM_BYTES = 8  # tokens are searched as int64s


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
        """Up to `max_tokens` drafts continuing `token_ids` (possibly none)."""
        if max_tokens <= 0 or len(token_ids) < self.min_n + 1:
            return ()
        # bytes.rfind is a C substring search: one pass per n, no Python loop over positions (this
        # runs for every decoding sequence on every speculating step).
        data = array("q", token_ids).tobytes()
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = _last_earlier_match(data, n)
            if start is not None:
                return tuple(token_ids[start + n : start + n + max_tokens])
        return ()


def _last_earlier_match(data: bytes, n: int) -> int | None:
    """Start (in tokens) of the latest occurrence of the last `n` tokens that ends before the last token."""
    suffix = data[-n * _ITEM_BYTES :]
    end = len(data) - _ITEM_BYTES  # the match must lie within every token but the last
    while (hit := data.rfind(suffix, 0, end)) >= 0:
        if hit % _ITEM_BYTES == 0:
            return hit // _ITEM_BYTES
        end = hit + len(suffix) - 1  # a match across token boundaries: look further back
    return None
