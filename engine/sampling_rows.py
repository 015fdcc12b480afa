"""The sampler's view of a step's sequences: one `SamplingRow` per logits row.

A row carries the sequence's prompt and output (uncopied: `TokenSlice`) because penalties and
min_tokens read them. Most steps need none of it: a greedy sequence with no penalties or bias, no logprobs
and min_tokens behind it takes the argmax of its raw logits, and the sampler reads nothing of its rows
but that. Such sequences share one stand-in row (`PLAIN_GREEDY_ROW`) instead of building one per
row: a speculative step has 1 + k rows per sequence, and on a fast device building them was a
measurable share of the step.

A structured-output sequence's rows carry its grammar's bitmask; `masks(seq, drafts, count)` (the
engine's `StructuredOutputs.masks`) gives them, None for an unconstrained sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from engine.logits_processing import SamplingRow
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

PLAIN_GREEDY_ROW = SamplingRow(SamplingParams(temperature=0.0), (), (), ())


def is_plain_greedy(seq: Sequence) -> bool:
    """Every row of `seq` this step is argmax of the raw logits (the sampler's fast path)."""
    p = seq.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.adjusts_logits
        and p.min_tokens <= seq.num_output_tokens
        and p.structured_output is None
    )


def sampling_row(
    seq: Sequence, eos_token_ids: tuple[int, ...], drafts: Seq[int] = (), grammar_bitmask: torch.Tensor | None = None
) -> SamplingRow:
    """The row sampling `seq`'s next token, or the token after `drafts` (speculative decoding)."""
    stop_ids = eos_token_ids + seq.params.stop_token_ids
    return SamplingRow(seq.params, seq.prompt_view(), seq.output_view(drafts), stop_ids, grammar_bitmask)


Masks = Callable[[Sequence, Seq[int], int], list[torch.Tensor] | None]


def step_rows(
    sequences_and_rows: Seq[tuple[Sequence, Seq[int], int]], eos_token_ids: tuple[int, ...], masks: Masks | None = None
):
    """Rows for (sequence, its drafts, its logits rows) in step order: row j of a sequence samples the
    token after its first j drafts."""
    rows: list[SamplingRow] = []
    for seq, drafts, count in sequences_and_rows:
        if is_plain_greedy(seq):
            rows.extend([PLAIN_GREEDY_ROW] * count)
            continue
        bitmasks = masks(seq, drafts, count) if masks is not None and seq.params.structured_output else None
        rows.extend(
            sampling_row(seq, eos_token_ids, drafts[:j], None if bitmasks is None else bitmasks[j])
            for j in range(count)
        )
    return rows
