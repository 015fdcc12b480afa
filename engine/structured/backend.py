"""The grammar backend contract: compile a spec against a vocabulary, then match one sequence.

A backend turns a `StructuredOutputSpec` into a compiled grammar for one vocabulary (the model's
tokenizer, padded to the LM head's width) and makes per-sequence matchers from it. Masks use one
layout for every backend: an int32 bitmask of `bitmask_words(vocab_size)` words per row, bit `t % 32`
of word `t // 32` set when token `t` is allowed (the layout xgrammar and llguidance both fill).

Contract (tests/engine/test_structured_backend.py runs it against every registered backend):
- `compile(spec)` returns the same object for an equal spec (an LRU keyed by spec and vocabulary
  identity), and raises `InvalidRequestError(spec.field, ...)`, one line, for a spec it cannot compile.
- A matcher starts at the beginning of the output; `fill_bitmask(out)` writes the allowed tokens of the
  next position into the int32 row `out`; `accept(token)` advances and returns False, unchanged, for a
  token the grammar forbids; `rollback(n)` undoes the last n accepted tokens; `is_terminated` is true
  once a stop token was accepted or the grammar can take nothing more. When the grammar is complete
  only the vocabulary's stop tokens (the model's EOS ids) are allowed.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.structured.spec import StructuredOutputSpec

MAX_ROLLBACK_TOKENS = 64  # speculative lookahead rolls back at most its drafts (k <= 16 in practice)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarMatcher(Protocol):
    def fill_bitmask(self, out: torch.Tensor) -> None:
        """Write the next position's allowed tokens into the int32 row `out` ([bitmask_words])."""

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (and no change) when the grammar forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted, or nothing more can follow."""


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the output."""


class GrammarBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); InvalidRequestError(spec.field, ...) when it cannot."""
