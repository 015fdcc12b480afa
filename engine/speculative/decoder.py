"""What one engine step does differently when it speculates: the engine's hooks, in step order.

1. `lookahead(running)`: the adaptive switch decides whether this step speculates; if so, the scheduler
   reserves up to k lookahead KV slots (and budget) per decoding sequence where they fit.
2. `propose(chunks, ...)`: the proposer fills each such chunk's slots with drafts, capped so that the
   sequence can never pass max_tokens or the model's length (accepted drafts + one token must fit).
   The chunk's input becomes its last token followed by the drafts: one target forward verifies every
   sequence's drafts (variable lengths, no padding: each verify chunk is its own segment).
3. `sample(...)`: every sampling chunk's tokens: one sampled token for plain chunks, accepted drafts
   plus one target token for verified ones (engine/speculative/rejection.py), with target logprobs.
4. `rollback(seq)`: after the engine appended the tokens (stopping at a stop condition) and marked the
   computed tokens (only accepted tokens, so only they are ever hashed into the prefix cache), the
   rejected drafts' KV slots are released: the block table shrinks to the computed tokens, freeing the
   blocks that held only rejected drafts. The draft model's count shrinks with it.
5. `observe(...)`: the step's measured cost feeds the switch; counters feed metrics. A step in which
   the draft caught up goes with the tokens its sequences are still expected to emit (`_tokens_ahead`:
   max_tokens, or the median output of the last finished requests where that is less and EOS can stop
   them; `finished` feeds it), over which the switch spreads the catch-up (catch_up.py).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from engine.sampler import Sampler, SamplingRow, TokenLogprobs, token_logprobs
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence
from engine.speculative.adaptive import AdaptiveSwitch
from engine.speculative.config import SpeculativeConfig
from engine.speculative.counters import SpecCounters
from engine.speculative.ngram import NgramProposer
from engine.speculative.rejection import Drafts, matching_prefix, verify


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, sampler: Sampler, max_model_len: int, draft_proposer=None):
        self.config = config
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.switch = AdaptiveSwitch(config.adaptive)
        self.draft = draft_proposer  # DraftModelProposer for method draft_model
        self.ngram = (
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if config.method == "ngram" else None
        )
        self.counters = SpecCounters()
        self._step = (False, 0, 0.0)  # (speculating, decoding sequences, start time) of the current step
        self._finished_outputs: deque[int] = deque(maxlen=64)  # output tokens of the last finished requests

    # ---- 1. decide --------------------------------------------------------------------------------
    def lookahead(self, running: Seq[Sequence]) -> int:
        decoding = sum(1 for seq in running if seq.num_uncomputed_tokens == 1)
        measurable = decoding == len(running)  # no running sequence has a prompt chunk due
        speculating = decoding > 0 and self.switch.decide(decoding, measurable)
        self._step = (speculating, decoding, time.perf_counter())
        if decoding:
            self.counters = self.counters._replace(
                steps_on=self.counters.steps_on + speculating, steps_off=self.counters.steps_off + (not speculating)
            )
        return self.config.num_speculative_tokens if speculating else 0

    # ---- 2. propose -------------------------------------------------------------------------------
    def propose(
        self,
        chunks: Seq[ScheduledChunk],
        block_table: Callable[[str], Seq[int]],
        sampling_row: Callable[[Sequence, Seq[int]], SamplingRow],
    ) -> tuple[list[ScheduledChunk], dict]:
        """Chunks with drafts filled in, and each drafted sequence's `Drafts` by id."""
        jobs = [(c.seq, min(c.num_lookahead_slots, self._room(c.seq))) for c in chunks if c.num_lookahead_slots]
        jobs = [(seq, k) for seq, k in jobs if k > 0]
        if self.ngram is not None:
            drafts = {seq.seq_id: Drafts(self.ngram.propose(seq.token_ids, k)) for seq, k in jobs}
        else:
            drafts = self.draft.propose(jobs, block_table, sampling_row) if jobs else {}
        out = []
        for chunk in chunks:
            tokens = drafts[chunk.seq.seq_id].token_ids if chunk.seq.seq_id in drafts else ()
            out.append(
                replace(chunk, num_new_tokens=chunk.num_new_tokens + len(tokens), draft_token_ids=tokens)
                if tokens
                else chunk
            )
        return out, {seq_id: d for seq_id, d in drafts.items() if d.token_ids}

    def _room(self, seq: Sequence) -> int:
        """Most drafts that keep accepted drafts + the target's token within max_tokens and the model."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1

    # ---- 3. sample / verify -----------------------------------------------------------------------
    def sample(
        self, chunks: Seq[ScheduledChunk], logits: torch.Tensor, rows: Seq[SamplingRow], drafts: dict
    ) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """(tokens, their target logprobs) per sampling chunk; `rows`/`logits` hold each chunk's
        `num_sampling_rows` rows in order.

        Plain chunks and greedy verify chunks share one sampler call (one argmax and one host copy per
        step, not one per sequence): a greedy verify row's token is the target's own pick, so the
        accepted drafts are the longest prefix equal to those picks and the logprobs of every emitted
        token are the call's. Random verify chunks take rejection sampling one by one."""
        offsets = [0]
        for chunk in chunks:
            offsets.append(offsets[-1] + chunk.num_sampling_rows)
        batched = [i for i, c in enumerate(chunks) if not c.draft_token_ids or rows[offsets[i]].params.greedy]
        spans = [offsets[i : i + 2] for i in batched]
        picks = dict(zip(batched, self._sample_batched(logits, rows, spans), strict=True))
        out = []
        for index, chunk in enumerate(chunks):
            drafted, (start, end) = chunk.draft_token_ids, offsets[index : index + 2]
            if index in picks:
                targets, target_logprobs = picks[index]
                emitted = 1 + matching_prefix(drafted, targets)
                tokens, logprobs = targets[:emitted], target_logprobs[:emitted]
            else:  # a random verify chunk: rejection sampling
                tokens = verify(self.sampler, logits[start:end], rows[start:end], drafts[chunk.seq.seq_id])
                ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
                logprobs = token_logprobs(logits[start : start + len(tokens)], rows[start : start + len(tokens)], ids)
            if drafted:
                self._count(chunk.seq, len(drafted), len(tokens) - 1)
            out.append((tokens, logprobs))
        return out

    def _sample_batched(
        self, logits: torch.Tensor, rows: Seq[SamplingRow], spans: list[list[int]]
    ) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """One sampler call over the rows of every (start, end) span; each span's tokens and logprobs."""
        if not spans:
            return []
        indices = [r for start, end in spans for r in range(start, end)]
        contiguous = indices == list(range(len(rows)))
        picked = logits if contiguous else logits[torch.tensor(indices, device=logits.device)]
        result = self.sampler(picked, [rows[r] for r in indices])
        out, at = [], 0
        for start, end in spans:
            out.append((result.token_ids[at : at + end - start], result.logprobs[at : at + end - start]))
            at += end - start
        return out

    def _count(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        seq.num_spec_steps += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += num_accepted
        c = self.counters
        self.counters = c._replace(
            sequence_steps=c.sequence_steps + 1,
            draft_tokens=c.draft_tokens + num_drafts,
            accepted_tokens=c.accepted_tokens + num_accepted,
        )

    # ---- 4. roll back -----------------------------------------------------------------------------
    @staticmethod
    def rollback(seq: Sequence, truncate: Callable[[str, int], None]) -> None:
        truncate(seq.seq_id, seq.num_computed_tokens)
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)

    # ---- 5. measure -------------------------------------------------------------------------------
    def observe(self, chunks: Seq[ScheduledChunk], num_output_tokens: int, num_step_tokens: int) -> None:
        """The step ended (`num_step_tokens` computed: drafts included); only pure decode steps (one new
        token per chunk besides its drafts: no prompt chunk) are cost samples. O(1) per step when it did
        not speculate: a step of a large batch is short on a GPU, where per-chunk loops show."""
        speculating, decoding, started_s = self._step
        num_drafts = sum(len(c.draft_token_ids) for c in chunks) if speculating else 0
        if not decoding or num_step_tokens - num_drafts != len(chunks):
            return
        duration_s = time.perf_counter() - started_s
        # The draft caught up a prompt's or a pause's KV: a one-off, not the per-step cost.
        catch_up = speculating and self.draft is not None and self.draft.caught_up
        catch_up_tokens = self.draft.caught_up_tokens if catch_up else 0
        tokens_ahead = self._tokens_ahead(self.draft.caught_up_seqs) if catch_up else 0
        drafted = num_drafts > 0  # else it cost a plain step
        most_tokens = len(chunks) + num_drafts if drafted else None
        self.switch.observe(
            drafted, decoding, duration_s, num_output_tokens, most_tokens, catch_up, catch_up_tokens, tokens_ahead
        )

    def finished(self, seq: Sequence) -> None:
        """A request ended by EOS, a stop or its length: its output length informs `_tokens_ahead`."""
        self._finished_outputs.append(seq.num_output_tokens)

    def _tokens_ahead(self, seqs: Seq[Sequence]) -> int:
        """Tokens `seqs` are still expected to emit: up to max_tokens, or up to the median output of
        the last finished requests where that is less and EOS may end them (at least 1 each)."""
        typical = statistics.median(self._finished_outputs) if self._finished_outputs else None
        total = 0
        for seq in seqs:
            limit = seq.params.max_tokens
            expected = limit if typical is None or seq.params.ignore_eos else min(limit, typical)
            total += max(int(expected) - seq.num_output_tokens, 1)
        return total


def build_speculative_decoder(
    config,
    model_config,
    draft_model_config,
    max_model_len: int,
    num_blocks: int,
    sampler: Sampler,
    progress: bool = False,
) -> SpeculativeDecoder | None:
    """The engine's decoder for `config.speculative_config` (None when speculation is off)."""
    spec = config.speculative_config
    if spec is None:
        return None
    draft = None
    if spec.method == "draft_model":
        from engine.speculative.draft_model import DraftModelProposer

        draft = DraftModelProposer(config, draft_model_config, max_model_len, num_blocks, sampler, progress)
    return SpeculativeDecoder(spec, sampler, max_model_len, draft)
