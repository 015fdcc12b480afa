"""The baseline `benchmarks/bench_engine.py` measures the engine against: `transformers` `generate`.

Greedy, left padding, no EOS, fp32: every row of a batch runs to the batch's largest max_tokens
(static batching); `check_tokens` compares the engine's greedy tokens with unbatched HF's.
"""

from __future__ import annotations

import time

import torch
from torch.nn.utils.rnn import pad_sequence

from benchmarks.throughput import BenchRequest, Throughput


class HFBaseline:
    """HF `generate`, greedy, left padding, no EOS: every row runs to the batch's max_new_tokens."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pad_id = self.model.config.pad_token_id or 0
        # A fresh generation config carries no eos_token_id, so no EOS stopping criterion is built.
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id)
        self.generate_batch([BenchRequest((5, 6, 7, 8), 2)])  # warm-up, as for the engine

    @torch.inference_mode()
    def generate_batch(self, batch: list[BenchRequest]) -> list[list[int]]:
        prompts = [torch.tensor(r.prompt_token_ids) for r in batch]
        ids = pad_sequence(prompts, batch_first=True, padding_value=self.pad_id, padding_side="left")
        mask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True, padding_side="left")
        width = ids.shape[1]
        steps = max(r.max_tokens for r in batch)
        out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=steps)
        if out.shape[1] != width + steps:
            raise RuntimeError(f"HF stopped early: {out.shape[1] - width} of {steps} tokens")
        return [out[row, width : width + r.max_tokens].tolist() for row, r in enumerate(batch)]

    def run(self, requests: list[BenchRequest], batch_size: int):
        batches = [requests[first : first + batch_size] for first in range(0, len(requests), batch_size)]
        start_s = time.perf_counter()
        tokens = [row for batch in batches for row in self.generate_batch(batch)]
        wall_s = time.perf_counter() - start_s
        computed = sum(len(batch) * max(r.max_tokens for r in batch) for batch in batches)
        return Throughput.of(requests, computed, wall_s), tokens


def check_tokens(hf: HFBaseline, requests, engine_tokens, known: list[list[int]]) -> dict:
    """Engine tokens vs unbatched HF; `known` holds HF B=1 tokens already computed for a prefix."""
    reference = known[: len(requests)]
    reference += [hf.generate_batch([r])[0] for r in requests[len(reference) :]]
    diverged = {
        index: next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
        )
        for index, (ours, theirs) in enumerate(zip(engine_tokens, reference, strict=True))
        if ours != theirs
    }
    return {
        "num_requests": len(requests),
        "num_identical": len(requests) - len(diverged),
        "first_divergence_by_request": diverged,
        "passed": not diverged,
    }
