"""The engine loop: `step()` = schedule → run → postprocess.

One engine serves three roles from the same code:
- colocated: prefill and decode in one process (the offline `LLM` and the baseline);
- prefill: a sequence finishes with `FinishReason.HANDOFF` right after its first token; its blocks stay
  pinned (`handoff_blocks`) until the caller `release`s them after the KV transfer;
- decode: `reserve` allocates blocks for KV that will arrive from a prefill worker, `adopt` then adds
  the sequence (prompt computed, first token sampled) to the running batch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from engine.allocator import keep_freed_memory
from engine.block_hash import HashNamespace
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv_cache_manager import KVCacheManager
from engine.model_loader import load_engine_model_config
from engine.model_runner import ModelRunner, StepInput, build_step_input, order_chunks
from engine.parallel import SINGLE_RANK, TensorParallelGroup
from engine.prompt_logprobs import take_prompt_logprobs
from engine.request_checks import check_new_request, check_resumed_outputs
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.sampling_rows import sampling_row, step_rows
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.speculative.decoder import build_speculative_decoder
from engine.speculative.draft_model import speculative_draft_config
from engine.step_updates import Handoff, SequenceUpdate
from engine.stop_checker import StopChecker
from engine.structured.matchers import StructuredOutputs
from engine.tokenizer import load_tokenizer


class LLMEngine:
    def __init__(
        self, config: EngineConfig, tp: TensorParallelGroup = SINGLE_RANK, progress: bool = False, on_kv_event=None
    ):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        keep_freed_memory()  # process-wide: an engine's process is there to run the engine
        self.config = config
        self.model_config = load_engine_model_config(config)
        self.max_model_len = config.max_len_for(self.model_config)
        draft_model_config = speculative_draft_config(config, self.model_config)
        self.num_blocks = config.num_blocks_for(self.model_config, draft_model_config)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching, on_event=on_kv_event)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.prefill_chunk_tokens), self.kv
        )
        self.runner = ModelRunner(config, self.model_config, self.max_model_len, self.num_blocks, tp, progress)
        self.sampler = Sampler(config.seed)
        self.spec = build_speculative_decoder(
            config, self.model_config, draft_model_config, self.max_model_len, self.num_blocks, self.sampler, progress
        )
        self.stops = StopChecker(config.model_dir, self.model_config.eos_token_ids, self.max_model_len)
        self.structured = StructuredOutputs(
            self.model_config.identity,
            lambda: load_tokenizer(config.model_dir),
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
        )
        self.seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        # Called with a step's chunks after scheduling, before the model runs (a prefill worker tells a
        # waiting request's caller that it is being computed now; see prefill_worker/first_token.py).
        self.on_scheduled: Callable[[Seq[ScheduledChunk]], None] | None = None

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        seq_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant_salt: str = "",
        arrival_time_s: float | None = None,
        output_token_ids: Seq[int] = (),
    ) -> Sequence:
        """Queue a request; raises InvalidRequestError naming the bad field (nothing else changes).
        `output_token_ids`: tokens the request already generated elsewhere (a migrated request resumes
        after them): they are output for penalties, seeded draws (by position), stop strings, min/max
        tokens, and the next token sampled is output number len(output_token_ids)."""
        seq = self._new_sequence(seq_id, prompt_token_ids, params, priority, tenant_salt, arrival_time_s)
        if output_token_ids:
            check_resumed_outputs(
                output_token_ids,
                seq.num_prompt_tokens,
                params,
                self.model_config.vocab_size,
                self.max_model_len,
                self.num_blocks,
                self.config.block_size,
            )
            seq.token_ids.extend(output_token_ids)
        self.structured.attach(seq)  # replays output_token_ids
        self.scheduler.add(seq)
        self.seqs[seq_id] = seq
        return seq

    def abort_request(self, seq_id: str) -> bool:
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT)
        self.release(seq_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def _new_sequence(self, seq_id, prompt_token_ids, params, priority, tenant_salt, arrival_time_s):
        if seq_id in self.seqs:
            raise InvalidRequestError("request_id", f"{seq_id!r} is already in use")
        tokens = check_new_request(
            prompt_token_ids,
            params,
            priority,
            self.model_config.vocab_size,
            self.max_model_len,
            self.num_blocks,
            self.config.block_size,
        )
        namespace = HashNamespace(self.model_config.identity, self.config.block_size, tenant_salt)
        return Sequence(
            seq_id=seq_id,
            token_ids=tokens,
            num_prompt_tokens=len(tokens),
            params=params,
            hash_namespace=namespace,
            priority=priority,
            arrival_order=next(self._arrivals),
            arrival_time_s=time.perf_counter() if arrival_time_s is None else arrival_time_s,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else [],  # token 0: nothing before it
        )

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[SequenceUpdate]:
        self.last_step_shape = (0, 0, 0)
        lookahead = self.spec.lookahead(self.scheduler.running) if self.spec is not None else 0
        scheduled = self.scheduler.schedule(lookahead)
        if not scheduled.chunks:
            return self._fail_unschedulable()
        chunks = list(scheduled.chunks)
        drafts: dict = {}  # seq id -> Drafts, when speculating
        if lookahead and self.spec is not None:
            chunks, drafts = self.spec.propose(chunks, self.kv.block_table, self._sampling_row)
        chunks = order_chunks(chunks, self.config.decode_chunk_tokens)
        if self.on_scheduled is not None:
            self.on_scheduled(chunks)
        # (tokens computed, sequences, KV tokens attended) of this step: the step log records it
        self.last_step_shape = (
            sum(c.num_new_tokens for c in chunks),
            len(chunks),
            sum(c.start + c.num_new_tokens for c in chunks),
        )
        step_input = build_step_input(
            chunks, self.kv.block_table, self.config.block_size, self.config.decode_chunk_tokens
        )
        logits = self.execute(step_input)
        updates = self._postprocess(chunks, logits, drafts)
        if self.spec is not None:
            self.spec.observe(chunks, sum(len(u.new_token_ids) for u in updates), self.last_step_shape[0])
        return updates

    def execute(self, step_input: StepInput) -> torch.Tensor:
        """Runs the model; a tensor-parallel driver overrides this to fan the step out to its ranks."""
        return self.runner.execute(step_input)

    def _postprocess(self, chunks: list[ScheduledChunk], logits: torch.Tensor, drafts: dict) -> list[SequenceUpdate]:
        now = time.perf_counter()
        logits = take_prompt_logprobs(chunks, logits)  # leaves the sampling rows
        sampling = [chunk for chunk in chunks if chunk.samples]
        for chunk in chunks:
            if not chunk.samples:
                self._mark_computed(chunk.seq, chunk.start + chunk.num_new_tokens)
        updates = []
        for chunk, (tokens, logprobs) in zip(sampling, self._sample(sampling, logits, drafts), strict=True):
            seq, reason, emitted = chunk.seq, None, []
            for token, logprob in zip(tokens, logprobs, strict=True):  # never past a stop: the rest is dropped
                self._append_token(seq, token, logprob, now)
                emitted.append(token)
                grammar_done = self.structured.advance(seq.seq_id, token)
                reason = FinishReason.STOP if grammar_done else self.stops.check(seq, token)
                if reason is not None:
                    break
            self._mark_computed(seq, seq.num_tokens - 1)  # the emitted tokens' inputs: accepted ones only
            if reason is None and self.config.role == "prefill":
                reason = FinishReason.HANDOFF
            if reason is not None:
                self._finish(seq, reason)
            elif chunk.num_lookahead_slots and self.spec is not None:
                self.spec.rollback(seq, self.kv.truncate)
            text_end_chars = None if seq.stop_text is None else len(seq.stop_text)
            updates.append(SequenceUpdate(seq.seq_id, tuple(emitted), reason, text_end_chars))
        return updates

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor, drafts: dict):
        eos = self.model_config.eos_token_ids
        rows = step_rows([(c.seq, c.draft_token_ids, c.num_sampling_rows) for c in chunks], eos, self.structured.masks)
        if self.spec is not None and drafts:  # no drafts this step: exactly the plain path
            return self.spec.sample(chunks, logits, rows, drafts)
        if not rows:
            return []
        result = self.sampler(logits, rows)
        return [([token], [logprob]) for token, logprob in zip(result.token_ids, result.logprobs, strict=True)]

    def _fail_unschedulable(self) -> list[SequenceUpdate]:
        # Nothing runs and the head of the queue still does not fit: it grew (prompt + output, after a
        # preemption) beyond the whole pool. Ending it is the only way forward; waiting would spin.
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        seq = self.scheduler.waiting[0]
        if -(-seq.num_tokens // self.config.block_size) <= self.num_blocks:
            return []  # it fits the pool; blocks held outside the scheduler (hand-off pins) free up soon
        self._finish(seq, FinishReason.LENGTH)
        return [SequenceUpdate(seq.seq_id, (), FinishReason.LENGTH)]

    def _mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        seq.num_computed_tokens = num_computed_tokens
        if self.kv.enable_prefix_caching:
            self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.refresh_block_hashes(), seq.num_computed_tokens)

    def _sampling_row(self, seq: Sequence, drafts: Seq[int] = ()) -> SamplingRow:
        return sampling_row(seq, self.model_config.eos_token_ids, drafts)

    @staticmethod
    def _append_token(seq: Sequence, token: int, logprobs, now: float) -> None:
        seq.token_ids.append(token)
        seq.token_times_s.append(now)
        if seq.first_token_time_s is None:
            seq.first_token_time_s = now
        if seq.params.logprobs is not None:
            seq.logprobs.append(logprobs)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if self.spec is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.spec.finished(seq)
        self.scheduler.remove(seq)
        self.structured.detach(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if reason is not FinishReason.HANDOFF:
            self.kv.free(seq.seq_id)

    def pop_finished(self, seq_id: str) -> Sequence:
        """Hand a finished sequence's state to the caller and forget it (a hand-off keeps it)."""
        seq = self.seqs[seq_id]
        if seq.finish_reason is not FinishReason.HANDOFF:
            del self.seqs[seq_id]
        return seq

    # ---- prefill role ---------------------------------------------------------------------------
    def handoff_blocks(self, seq_id: str) -> Handoff:
        seq = self.seqs[seq_id]
        num_blocks = (seq.num_computed_tokens + self.config.block_size - 1) // self.config.block_size
        return Handoff(
            seq_id,
            tuple(seq.token_ids),
            seq.num_computed_tokens,
            tuple(self.kv.block_table(seq_id)[:num_blocks]),
            tuple(seq.block_hashes),
        )

    def release(self, seq_id: str) -> None:
        """Drop a sequence's pins after a hand-off (or a reservation that will not be used)."""
        self.kv.free(seq_id)
        self.structured.detach(seq_id)
        self.seqs.pop(seq_id, None)

    # ---- decode role ----------------------------------------------------------------------------
    def reserve(self, seq_id: str, num_tokens: int) -> tuple[int, ...]:
        """Allocate blocks for `num_tokens` of KV that another worker will fill; raises when full."""
        if self.kv.has(seq_id) or seq_id in self.seqs:
            raise InvalidRequestError("request_id", f"{seq_id!r} is already in use")
        if not self.kv.can_allocate(seq_id, num_tokens):
            raise MemoryError(f"no room for {num_tokens} tokens of KV ({self.kv.num_free_blocks} free blocks)")
        return tuple(self.kv.allocate(seq_id, num_tokens))

    def adopt(
        self,
        seq_id: str,
        token_ids: Seq[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant_salt: str = "",
        arrival_time_s: float | None = None,
    ) -> Sequence:
        """Continue a sequence whose first `len(token_ids) - 1` tokens' KV fills its reserved blocks."""
        seq = self._new_sequence(seq_id, token_ids[:num_prompt_tokens], params, priority, tenant_salt, arrival_time_s)
        seq.token_ids = list(token_ids)
        seq.num_computed_tokens = len(token_ids) - 1
        seq.num_cached_tokens = 0
        self.structured.attach(seq)  # replays the first token, sampled under the grammar by the prefill worker
        self.seqs[seq_id] = seq
        self.scheduler.add_running(seq)
        return seq
