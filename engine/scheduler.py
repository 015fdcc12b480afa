"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step:
1. Running sequences, most important first, each get up to `prefill_chunk_tokens` of their uncomputed
   tokens (a decoding sequence needs exactly one). When the KV pool cannot grow a sequence, the least
   important running sequence (lowest priority, latest arrival) is preempted — its blocks freed, its
   computed count reset — until the sequence fits or is itself the one preempted.
2. If nothing was preempted, waiting sequences are admitted in priority order (FCFS within a priority)
   while the budget, `max_num_seqs` and the pool allow; a new sequence starts after its cached prefix
   (from 0 while it owes prompt logprobs: a cached position has no logits).

The scheduler asks the KV manager (`can_allocate`) before it acts (`allocate`); it never touches
block lists itself.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.kv_cache_manager import CachedPrefix, KVCacheManager
from engine.prompt_logprobs import num_prompt_logprob_rows, owes_prompt_logprobs
from engine.sequence import Sequence, SequenceStatus

NO_CACHED_PREFIX = CachedPrefix(block_ids=(), num_tokens=0)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_tokens: int


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of `seq` starting at `start` are computed this step.

    Speculative decoding: a decoding sequence may get `num_lookahead_slots` more KV slots than its one
    new token; the proposer then fills some of them with `draft_token_ids`, which follow the sequence's
    tokens as input (`num_new_tokens` counts them) and are verified from this step's logits.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    num_lookahead_slots: int = 0
    draft_token_ids: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so its last logits sample a token."""
        return self.start + self.num_new_tokens == self.seq.num_tokens + len(self.draft_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        end = self.start + self.num_new_tokens
        if not self.draft_token_ids:
            return self.seq.token_ids[self.start : end]
        return (self.seq.token_ids + list(self.draft_token_ids))[self.start : end]

    @property
    def num_sampling_rows(self) -> int:
        """Rows that sample: the last, plus one per draft (each is verified); none before the end."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    @property
    def num_prompt_logprob_rows(self) -> int:
        """Rows scoring prompt tokens whose logprobs are owed (engine/prompt_logprobs.py); before the
        sampling rows."""
        return num_prompt_logprob_rows(self.seq, self.start, self.num_new_tokens)

    @property
    def num_logits_rows(self) -> int:
        """Rows whose logits the step returns: this chunk's last rows."""
        return self.num_prompt_logprob_rows + self.num_sampling_rows


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.num_preemptions = 0  # since start; a worker exports it as a counter

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a sequence whose KV blocks are already allocated and filled (decode role)."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues (its blocks are the caller's call)."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_lookahead_tokens: int = 0) -> SchedulerOutput:
        """`num_lookahead_tokens`: KV slots (and budget) to reserve for speculative drafts beyond each
        decoding sequence's one token, where they fit without preempting anyone."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, self.config.prefill_chunk_tokens, budget)
            if self._make_room(seq, num_new, preempted):
                extra = self._lookahead_room(seq, min(num_lookahead_tokens, budget - num_new))
                self.kv.allocate(seq.seq_id, seq.num_computed_tokens + num_new + extra)
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new, extra))
                budget -= num_new + extra
        if not preempted:
            chunks.extend(self._admit_waiting(budget))
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _lookahead_room(self, seq: Sequence, wanted: int) -> int:
        """Speculation only for a decoding sequence, and never at the price of a preemption: the
        lookahead blocks must leave one free block per running sequence (each may need one to grow)."""
        if wanted <= 0 or seq.num_uncomputed_tokens != 1:
            return 0
        extra_blocks = -(-(seq.num_tokens + wanted) // self.kv.block_size) - len(self.kv.block_table(seq.seq_id))
        return wanted if self.kv.num_free_blocks - max(extra_blocks, 0) >= len(self.running) else 0

    def _make_room(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
        while not self.kv.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.reset_for_recompute()
        self.add(seq)

    def _admit_waiting(self, budget: int) -> list[ScheduledChunk]:
        chunks = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            num_new = min(seq.num_tokens - cached.num_tokens, self.config.prefill_chunk_tokens, budget)
            if not self.kv.can_allocate(seq.seq_id, cached.num_tokens + num_new, cached):
                break
            self.kv.allocate(seq.seq_id, cached.num_tokens + num_new, cached)
            self.waiting.pop(0)
            seq.num_computed_tokens = cached.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached.num_tokens
            self.add_running(seq)
            chunks.append(ScheduledChunk(seq, cached.num_tokens, num_new))
            budget -= num_new
        return chunks

    def _cached_prefix(self, seq: Sequence) -> CachedPrefix:
        if not self.kv.enable_prefix_caching or owes_prompt_logprobs(seq):
            return NO_CACHED_PREFIX
        return self.kv.find_cached_prefix(seq.token_ids, seq.refresh_block_hashes())
