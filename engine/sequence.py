"""Per-request state: counters, not flags.

The one rule behind chunked prefill, prefix hits, preemption and prefill-here/decode-there: each step
computes some of the tokens in `[num_computed_tokens, num_tokens)`; once a sequence has computed all
its tokens, the step's logits sample the next token. Everything else is derived from the counters.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from collections.abc import Sequence as AbcSequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_hash import BlockHash, HashNamespace, extend_block_hashes
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and format() of members
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's length limit
    ABORT = "abort"  # cancelled by the caller
    HANDOFF = "handoff"  # prefill role: first token sampled, KV blocks go to a decode instance


class TokenSlice(AbcSequence[int]):
    """`tokens[start:stop] + extra` without the copy: a sampling row reads a sequence's prompt and output
    only for penalties (rare), but one is built per row on every step (hundreds with speculation). It is
    valid while `tokens` is unchanged: within the step that built it."""

    __slots__ = ("_extra", "_start", "_stop", "_tokens")

    def __init__(self, tokens: list[int], start: int, stop: int, extra: AbcSequence[int] = ()):
        self._tokens, self._start, self._stop, self._extra = tokens, start, stop, extra

    def __len__(self) -> int:
        return self._stop - self._start + len(self._extra)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(itertools.islice(self._tokens, self._start, self._stop), self._extra)

    def __getitem__(self, index):  # int or slice, as a list answers
        return [*self][index]


@dataclass(eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    hash_namespace: HashNamespace
    arrival_time_s: float
    arrival_order: int
    priority: int = 0  # higher is more important; FCFS within a priority
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    first_token_time_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    # params.prompt_logprobs: None for the first prompt token, then a TokenLogprobs per prompt token, filled
    # as the prompt's chunks are computed (engine/prompt_logprobs.py).
    prompt_logprobs: list = field(default_factory=list)
    # Speculative decoding: tokens whose KV the draft model holds (its own cache, same block table),
    # and what verification did for this sequence (RequestOutput metrics).
    num_draft_computed_tokens: int = 0
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    stop_text: str | None = None  # output text when a stop string ended the sequence (cut before it)
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)  # only for stop strings

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def prompt_view(self) -> TokenSlice:
        return TokenSlice(self.token_ids, 0, self.num_prompt_tokens)

    def output_view(self, then: AbcSequence[int] = ()) -> TokenSlice:
        """The output so far, followed by `then` (speculative drafts), uncopied."""
        return TokenSlice(self.token_ids, self.num_prompt_tokens, len(self.token_ids), then)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """More than the one newest token is uncomputed: a prompt (or recompute) chunk is due."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        return (-self.priority, self.arrival_order)

    def refresh_block_hashes(self) -> list[BlockHash]:
        """Extend the chained hashes to every full block of the current tokens."""
        self.block_hashes = extend_block_hashes(self.hash_namespace, self.token_ids, self.block_hashes)
        return self.block_hashes

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop all computed KV; the tokens themselves are kept."""
        self.num_computed_tokens = 0
        self.num_draft_computed_tokens = 0
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING
