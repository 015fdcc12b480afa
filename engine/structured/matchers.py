"""The engine's structured-output state: a grammar matcher per constrained sequence.

Where the matcher lives on each path is in docs/architecture.md#structured-outputs. In short: the
engine that samples a sequence's token owns its matcher. It is built when the sequence enters the
engine (`attach`) by replaying the output the sequence already has (none for a new request; the first
token on a decode instance that adopts a hand-off; every token so far for a migrated request), masks
every sampling row of the sequence (`masks`, drafts included), advances with every emitted token
(`advance`) and is dropped when the sequence ends (`detach`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from engine.errors import InvalidRequestError
from engine.sequence import Sequence
from engine.structured.backend import GrammarBackend, GrammarMatcher, bitmask_words
from engine.structured.registry import grammar_backend


class StructuredOutputs:
    """One engine's matchers, by sequence id. The backend (and the tokenizer it needs) is built on the
    first constrained request: engines that never see one never load it."""

    def __init__(self, vocab_key: str, load_tokenizer: Callable[[], object], vocab_size: int, eos_ids: tuple[int, ...]):
        self._vocab = (vocab_key, load_tokenizer, vocab_size, eos_ids)
        self.matchers: dict[str, GrammarMatcher] = {}

    @property
    def backend(self) -> GrammarBackend:
        return grammar_backend(*self._vocab)

    def attach(self, seq: Sequence) -> None:
        """Give `seq` its matcher, replaying its output so far; InvalidRequestError (naming the spec's
        field) when the spec cannot be compiled or the output does not match it."""
        spec = seq.params.structured_output
        if spec is None:
            return
        matcher = self.backend.compile(spec).matcher()
        for position, token in enumerate(seq.output_token_ids):
            if not matcher.accept(token):
                raise InvalidRequestError(spec.field, f"output token {position} ({token}) does not match the grammar")
        self.matchers[seq.seq_id] = matcher

    def detach(self, seq_id: str) -> None:
        self.matchers.pop(seq_id, None)

    def masks(self, seq: Sequence, drafts: Seq[int], count: int) -> list[torch.Tensor] | None:
        """The bitmask of each of `seq`'s `count` rows this step (row j follows drafts[:j]); None for an
        unconstrained sequence. Drafts are accepted to reach their rows and rolled back after; rows past
        a draft the grammar forbids are never used (verification rejects that draft) and copy the last
        reachable row."""
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None:
            return None
        out = torch.zeros(count, bitmask_words(self.backend.vocab_size), dtype=torch.int32)
        reached = 0  # drafts accepted into the matcher
        matcher.fill_bitmask(out[0])
        for j in range(1, count):
            if reached == j - 1 and not matcher.is_terminated and matcher.accept(drafts[j - 1]):
                reached = j
                if not matcher.is_terminated:
                    matcher.fill_bitmask(out[j])
                    continue
            out[j] = out[j - 1]
        matcher.rollback(reached)
        return list(out)

    def advance(self, seq_id: str, token: int) -> bool:
        """Accept an emitted token; True when the sequence must end here: the grammar is complete (or,
        defensively, the token does not fit it)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return False
        return not matcher.accept(token) or matcher.is_terminated
