"""Teacher forcing: the logits an engine gives at every step of a given continuation.

Row i of a sequence's result predicts `continuation[i]` from `prompt + continuation[:i]`. The prompt
is prefilled in the engine's chunks, then each continuation token goes through a decode step that
reads every earlier token's KV from the paged cache, exactly as generation does, so a quantized KV
cache or quantized weights are measured where they act. Sequences decode together in one batch.
Used by the quantization accuracy report (benchmarks/quant_accuracy.py) and its tests.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.block_hash import HashNamespace
from engine.llm_engine import LLMEngine
from engine.model_runner import build_step_input, order_chunks
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence


@torch.inference_mode()
def teacher_forced_logits(
    engine: LLMEngine, prompts: Seq[Seq[int]], continuations: Seq[Seq[int]]
) -> list[torch.Tensor]:
    """fp32 logits `[len(continuation), vocab]` per sequence; the engine must be idle (its blocks free)."""
    if len(prompts) != len(continuations) or any(not p or not c for p, c in zip(prompts, continuations, strict=True)):
        raise ValueError("teacher forcing needs one non-empty continuation per non-empty prompt")
    seqs = [_sequence(engine, f"teacher-forced-{i}", p) for i, p in enumerate(prompts)]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    try:
        for i, seq in enumerate(seqs):
            engine.kv.allocate(seq.seq_id, seq.num_tokens + len(continuations[i]) - 1)
            rows[i].append(_prefill(engine, seq))
        for step in range(1, max(map(len, continuations))):
            live = [(i, seq) for i, seq in enumerate(seqs) if step < len(continuations[i])]
            for i, seq in live:
                seq.token_ids.append(continuations[i][step - 1])
            chunks = [ScheduledChunk(seq, seq.num_tokens - 1, 1) for _, seq in live]
            logits = _run(engine, chunks)
            for row, (i, _) in enumerate(live):
                rows[i].append(logits[row])
    finally:
        for seq in seqs:
            engine.kv.free(seq.seq_id)
    return [torch.stack(r) for r in rows]


def _sequence(engine: LLMEngine, seq_id: str, prompt: Seq[int]) -> Sequence:
    namespace = HashNamespace(engine.model_config.identity, engine.config.block_size)
    return Sequence(
        seq_id=seq_id,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        params=SamplingParams(temperature=0.0),
        hash_namespace=namespace,
        arrival_time_s=0.0,
        arrival_order=0,
    )


def _prefill(engine: LLMEngine, seq: Sequence) -> torch.Tensor:
    """Computes the prompt in the engine's chunks; returns the last chunk's logits row."""
    chunk_tokens = engine.config.prefill_chunk_tokens
    for start in range(0, seq.num_tokens, chunk_tokens):
        logits = _run(engine, [ScheduledChunk(seq, start, min(chunk_tokens, seq.num_tokens - start))])
    return logits[-1]


def _run(engine: LLMEngine, chunks: list[ScheduledChunk]) -> torch.Tensor:
    ordered = order_chunks(chunks)
    if ordered != chunks:
        raise AssertionError("teacher forcing builds its steps in execution order")
    step = build_step_input(ordered, engine.kv.block_table, engine.config.block_size)
    return engine.execute(step)
