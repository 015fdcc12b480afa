"""Draft-model proposals: a smaller checkpoint of the same tokenizer proposes k tokens per sequence.

The draft has its own paged KV cache (a `ModelRunner` of its own, in the engine's KV format) with the
same block count and block size as the target's, and it reads and writes it through the TARGET's block
tables: a token at position p lives in the same slot in both caches. So the draft needs no allocator of
its own, the scheduler's lookahead slots cover its drafts too, and rolling back the target's table
(freeing emptied blocks) rolls back the draft's.

`Sequence.num_draft_computed_tokens` counts the tokens whose draft KV is valid. Each proposal first
catches the draft up from there to the sequence's end in one chunk (after admission, a prefix-cache hit,
a preemption or an adopted hand-off that is the whole prompt; after a step, the tokens the target
accepted beyond the draft's own), then runs k - 1 single-token steps. A sequence lagging by more than
`prefill_chunk_tokens` catches up by that many tokens per step instead, proposing nothing
meanwhile. All sequences of a step share each forward (variable catch-up lengths, no padding).
Prefix-cached blocks are not trusted for draft KV: a sequence starts its count at 0 and rewrites
those slots with the same values.

The draft runs unsharded on the engine's own process: in a tensor-parallel decode instance only rank 0
(which schedules and samples) runs it; the other ranks never see it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.errors import UnsupportedModelError
from engine.model_loader import load_model_config
from engine.model_runner import ModelRunner, StepInput, build_step_input, order_chunks
from engine.parallel import SINGLE_RANK
from engine.sampler import Sampler, SamplingRow, processed_logits
from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.rejection import Drafts

DRAFT_STREAM = 0x5EC_D2AF7  # seeds the draft's own sampling noise (seeded requests)


@dataclass(frozen=True)
class DraftChunk:
    """One draft forward's rows for one sequence (the `build_step_input` chunk protocol)."""

    seq: Sequence
    start: int
    input_token_ids: list[int]
    num_logits_rows: int = 1

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_token_ids)


def _draft_dir(config: EngineConfig) -> str:
    """The draft checkpoint of a config speculating with a draft model (EngineConfig normalised it)."""
    spec = config.speculative_config
    assert isinstance(spec, SpeculativeConfig) and spec.model is not None, "a draft_model config names its model"
    return spec.model


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """How the draft runs: the target's settings on its own checkpoint, unsharded, never speculating,
    with its own weight quantization where `speculative_config.quantization` names one."""
    spec = config.speculative_config
    assert isinstance(spec, SpeculativeConfig)
    quantization = config.quantization if spec.quantization is None else spec.quantization
    return replace(
        config,
        model_dir=_draft_dir(config),
        tp_size=1,
        speculative_config=None,
        quantization=quantization,
        quantization_group_size=config.quantization_group_size if quantization != "none" else None,
        quantize_lm_head=config.quantize_lm_head and quantization != "none",
    )


def load_draft_model_config(config: EngineConfig, target: ModelConfig) -> ModelConfig:
    """The draft's config, refused (naming speculative_config.model) unless it speaks the target's
    vocabulary: same vocab size, and the same tokenizer vocabulary where both ship a tokenizer.json."""
    draft_dir = _draft_dir(config)
    draft = load_model_config(draft_dir, config.dtype if config.dtype != "auto" else target.dtype)
    if draft.vocab_size != target.vocab_size:
        raise UnsupportedModelError(
            f"speculative_config.model: the draft's vocab_size {draft.vocab_size} differs "
            f"from the target's {target.vocab_size}; a draft needs the same vocabulary"
        )
    mine, theirs = _tokenizer_vocab(draft_dir), _tokenizer_vocab(config.model_dir)
    if mine is not None and theirs is not None and mine != theirs:
        raise UnsupportedModelError(
            "speculative_config.model: the draft's tokenizer.json vocabulary differs from "
            "the target's; a draft needs the same tokenizer"
        )
    return draft


def _tokenizer_vocab(model_dir: str) -> dict | None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("model", {}).get("vocab")


class DraftModelProposer:
    def __init__(
        self,
        config: EngineConfig,
        draft_model: ModelConfig,
        max_model_len: int,
        num_blocks: int,
        sampler: Sampler,
        progress: bool = False,
    ):
        # The draft's chunks after a verify step (accepted drafts + the new token) are as short as a
        # verify chunk: decode rows, as in the target (graphs on CUDA included).
        self.decode_chunk_tokens = config.decode_chunk_tokens
        self.runner = ModelRunner(
            draft_engine_config(config),
            draft_model,
            max_model_len,
            num_blocks,
            SINGLE_RANK,
            progress,
            max_decode_rows=config.max_num_seqs * self.decode_chunk_tokens,
        )
        self.block_size = config.block_size
        self.caught_up = False  # the last proposal caught some sequence's draft KV up by more than a step
        self.caught_up_tokens = 0  # tokens of draft KV it computed for the sequences that lagged so
        self.caught_up_seqs: list[Sequence] = []  # those sequences
        self.max_catch_up_tokens = config.prefill_chunk_tokens
        self.sampler = sampler

    def propose(
        self,
        jobs: Seq[tuple[Sequence, int]],
        block_table: Callable[[str], Seq[int]],
        sampling_row: Callable[[Sequence, Seq[int]], SamplingRow],
    ) -> dict[str, Drafts]:
        """Up to k drafts for each (sequence, k); `sampling_row(seq, drafts)` is the row sampling the
        token after `drafts`. The draft's KV slots must already be allocated (lookahead slots)."""
        # Catching up more than a verify chunk's worth (a new prompt, a hand-off, steps without
        # speculation) is a one-off per sequence, not what speculating costs per step.
        lags = {seq.seq_id: seq.num_tokens - seq.num_draft_computed_tokens for seq, _ in jobs}
        self.caught_up_seqs = [seq for seq, _ in jobs if lags[seq.seq_id] > self.decode_chunk_tokens]
        self.caught_up_tokens = sum(min(lags[seq.seq_id], self.max_catch_up_tokens) for seq in self.caught_up_seqs)
        self.caught_up = self.caught_up_tokens > 0
        jobs = self._catch_up_lagging(jobs, block_table)
        tokens: dict[str, list[int]] = {seq.seq_id: [] for seq, _ in jobs}
        probs: dict[str, list[torch.Tensor | None]] = {seq.seq_id: [] for seq, _ in jobs}
        for step in range(max((k for _, k in jobs), default=0)):
            active = [seq for seq, k in jobs if k > step]
            chunks = order_chunks([self._chunk(seq, tokens[seq.seq_id]) for seq in active], self.decode_chunk_tokens)
            logits = self.runner.execute(self._step_input(chunks, block_table))
            rows = [sampling_row(chunk.seq, tokens[chunk.seq.seq_id]) for chunk in chunks]
            for chunk, token, q in zip(chunks, *self._choose(logits, rows), strict=True):
                tokens[chunk.seq.seq_id].append(token)
                probs[chunk.seq.seq_id].append(q)
                chunk.seq.num_draft_computed_tokens = chunk.start + chunk.num_new_tokens
        return {seq_id: Drafts(tuple(ids), _stack(probs[seq_id])) for seq_id, ids in tokens.items()}

    def _catch_up_lagging(self, jobs, block_table) -> list[tuple[Sequence, int]]:
        """Sequences whose draft KV lags by more than `max_catch_up_tokens` (a long prompt just handed
        off or re-admitted) catch up by that much this step and propose nothing: the draft's share of
        a step stays bounded like a prefill chunk, instead of stalling the whole decode batch once."""
        cap = self.max_catch_up_tokens
        lagging = [seq for seq, _ in jobs if seq.num_tokens - seq.num_draft_computed_tokens > cap]
        if not lagging:
            return list(jobs)
        chunks = [
            DraftChunk(seq, seq.num_draft_computed_tokens, seq.token_ids[seq.num_draft_computed_tokens :][:cap], 0)
            for seq in lagging
        ]
        self.runner.forward(self._step_input(order_chunks(chunks, self.decode_chunk_tokens), block_table))
        for chunk in chunks:
            chunk.seq.num_draft_computed_tokens += chunk.num_new_tokens
        return [(seq, k) for seq, k in jobs if seq not in lagging]

    def _step_input(self, chunks: list[DraftChunk], block_table: Callable[[str], Seq[int]]) -> StepInput:
        return build_step_input(chunks, block_table, self.block_size, self.decode_chunk_tokens)

    @staticmethod
    def _chunk(seq: Sequence, drafted: list[int]) -> DraftChunk:
        if drafted:  # the previous draft token is this step's input
            return DraftChunk(seq, seq.num_tokens - 1 + len(drafted), [drafted[-1]])
        start = min(seq.num_draft_computed_tokens, seq.num_tokens - 1)
        return DraftChunk(seq, start, seq.token_ids[start:])

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Greedy rows: the draft's argmax (a deterministic proposal, q = None). Random rows: a sample of
        the draft's processed distribution q, which verification needs."""
        processed = processed_logits(logits, rows)
        tokens = processed.argmax(dim=-1).tolist()
        qs: list[torch.Tensor | None] = [None] * len(rows)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random:
            q = processed[random].softmax(dim=-1)
            noise = self.sampler.exponential_noise([rows[i] for i in random], q, DRAFT_STREAM)
            for j, (i, token) in enumerate(zip(random, (q / noise).argmax(dim=-1).tolist(), strict=True)):
                tokens[i], qs[i] = token, q[j]
        return tokens, qs


def _stack(probs: list[torch.Tensor | None]) -> torch.Tensor | None:
    tensors = [p for p in probs if p is not None]
    if not probs or len(tensors) < len(probs):  # greedy rows carry no distribution
        return None
    return torch.stack(tensors)


def speculative_draft_config(config: EngineConfig, target: ModelConfig) -> ModelConfig | None:
    """The draft model's config when `config` speculates with one (sizes the KV pool on every rank)."""
    spec = config.speculative_config
    if not isinstance(spec, SpeculativeConfig) or spec.method != "draft_model":
        return None
    return load_draft_model_config(config, target)
