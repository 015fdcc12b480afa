"""Prompt logprobs (`params.prompt_logprobs`, vLLM's field): the logprob of every prompt token after
the first, given the tokens before it, with the top alternatives, under the raw logits (as `logprobs`).

Position p's logits score token p + 1. A chunk of a sequence that owes prompt logprobs therefore also
returns the logits of its positions from the first owed one up to the prompt's second-to-last; the model
runner returns a chunk's last rows, and these sit just before the sampling row: a chunk either ends
inside the prompt (no sampling row) or at its end (whose last position samples the first output token).
`take_prompt_logprobs` records them and hands the sampler the sampling rows alone.

Rules that keep it exact and simple:
- they are owed only while the sequence has no output token: a request resumed after output tokens (a
  migrated one) does not compute them again, so its chunks never mix prompt and output positions;
- while any are owed the sequence reads no prefix-cache hits (a cached position has no logits);
- after a preemption mid-prompt, positions already recorded are not recorded twice.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from engine.sampler import raw_logprobs
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.scheduler import ScheduledChunk  # which imports this module


def owes_prompt_logprobs(seq: Sequence) -> bool:
    return (
        seq.params.prompt_logprobs is not None
        and seq.num_output_tokens == 0
        and len(seq.prompt_logprobs) < seq.num_prompt_tokens
    )


def num_prompt_logprob_rows(seq: Sequence, start: int, num_new_tokens: int) -> int:
    """Rows of the chunk [start, start + num_new_tokens) that score prompt tokens still owed."""
    if not owes_prompt_logprobs(seq):
        return 0
    first = max(start, len(seq.prompt_logprobs) - 1)  # the position scoring the next token owed
    end = min(start + num_new_tokens, seq.num_prompt_tokens - 1)
    return max(0, end - first)


def take_prompt_logprobs(chunks: Seq[ScheduledChunk], logits: torch.Tensor) -> torch.Tensor:
    """Records the prompt logprobs of this step's chunks (`logits` holds each chunk's rows in order, its
    prompt rows first) and returns the sampling rows alone: `logits` itself when no chunk had prompt rows."""
    counts = [chunk.num_prompt_logprob_rows for chunk in chunks]
    if not any(counts):
        return logits
    prompt_rows: list[int] = []
    targets: list[int] = []
    top_counts: list[int] = []
    keep: list[int] = []
    at = 0
    for chunk, count in zip(chunks, counts, strict=True):
        if count:
            seq = chunk.seq
            first = chunk.start + chunk.num_new_tokens - chunk.num_logits_rows  # the first row's position
            prompt_rows.extend(range(at, at + count))
            targets.extend(seq.token_ids[first + 1 : first + 1 + count])
            top_counts.extend([seq.params.prompt_logprobs or 0] * count)
        keep.extend(range(at + count, at + chunk.num_logits_rows))
        at += chunk.num_logits_rows
    index = torch.tensor(prompt_rows, dtype=torch.long, device=logits.device)
    found = iter(raw_logprobs(logits[index], torch.tensor(targets, device=logits.device), top_counts))
    for chunk, count in zip(chunks, counts, strict=True):
        chunk.seq.prompt_logprobs.extend(next(found) for _ in range(count))
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
