"""The batched token sampler: one call per engine step picks the next token of every running sequence.

Per row, in order:

1. The logits are processed as `engine.logits_processing` documents: the structured-output mask,
   min_tokens masking, logit_bias, repetition penalty (HF semantics, prompt + output), presence /
   frequency penalty (OpenAI / vLLM semantics, output only), then for random rows temperature, top-k,
   top-p and min-p (HF warper semantics).
2. Greedy rows (temperature == 0) take the argmax of the penalised logits; ties go to the lowest token id.
3. Random rows sample from the softmax of the processed logits by the exponential race: draw
   q ~ Exp(1) per vocab entry and pick argmax(probs / q), which picks token i with probability probs[i].
4. Where that noise comes from:
   - a row with `params.seed` draws it from a generator re-seeded with
     `row_generator_seed(seed, position)`, position = len(output_token_ids). The draw therefore depends
     only on (seed, position) and the row's own logits: never on batch composition, on other rows or on
     what ran before, so it replays identically in another process and after preemption and recompute
     (for the same torch version and device type; CPU and CUDA generators produce different streams);
   - every other random row draws from the Sampler's own generator, seeded once at construction.
5. Logprobs, when `params.logprobs` is not None, are log_softmax of the RAW logits, before any penalty,
   mask, temperature or filter. That is vLLM's default: the numbers describe the model rather than the
   sampling settings, and a request's logprobs do not change with its sampling knobs.

When every row is greedy with no penalties or bias, no min_tokens masking in effect and no logprobs, the step is
one batched argmax with no per-row tensor work: the common case for evaluation and benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.logits_processing import SamplingRow, check_batch_shape, processed_logits

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "TokenLogprobs",
    "processed_logits",
    "raw_logprobs",
    "row_generator_seed",
    "token_logprobs",
]

_MASK_64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2**64 / golden ratio, made odd


@dataclass(frozen=True)
class TokenLogprobs:
    sampled_logprob: float  # of the token sampled (or, for prompt logprobs, of the prompt's own token)
    top: tuple[tuple[int, float], ...]  # top-n (token_id, logprob), highest first; n = params.logprobs


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection on 64-bit ints; every output bit depends on every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


def row_generator_seed(seed: int, position: int) -> int:
    """Generator seed for a seeded row's draw at `position`: a spec, identical in every process.

    It is output number `position` of a SplitMix64 stream whose state starts at mix64(seed), computed on
    Python ints (Python's hash() is salted per process, so it cannot be used). Consecutive positions get
    unrelated seeds, so their draws are independent.
    """
    return _mix64((_mix64(seed) + (position + 1) * _GOLDEN_GAMMA) & _MASK_64)


class Sampler:
    """Picks one token per row. Not thread-safe: it owns generator state advanced by every call."""

    def __init__(self, seed: int = 0):
        self._seed = seed
        # Generators live on the device they serve; created on first use so a CPU-only process never
        # touches CUDA. `_unseeded` streams are advanced by every call; `_scratch` is re-seeded per row.
        self._unseeded: dict[torch.device, torch.Generator] = {}
        self._scratch: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample the next token of every row; `logits` is [len(rows), vocab] and is not modified."""
        check_batch_shape(logits, rows)
        if all(_is_plain_greedy(row) for row in rows):
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=[None] * len(rows))
        token_ids = self._choose(processed_logits(logits, rows), rows)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=token_logprobs(logits, rows, token_ids))

    def _choose(self, processed: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        token_ids = torch.empty(len(rows), dtype=torch.long, device=processed.device)
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if greedy:
            index = _index(greedy, processed)
            token_ids[index] = processed[index].argmax(dim=-1)
        if random:
            index = _index(random, processed)
            probs = processed[index].softmax(dim=-1)
            noise = self.exponential_noise([rows[i] for i in random], processed)
            token_ids[index] = (probs / noise).argmax(dim=-1)
        return token_ids

    def exponential_noise(self, rows: Sequence[SamplingRow], like: torch.Tensor, stream: int = 0) -> torch.Tensor:
        """Exp(1) noise, one [vocab] row per entry of `rows`, each from the source step 4 assigns it.
        `stream` != 0 names another seeded stream (speculative decoding's draws), independent of the
        sampler's own: a seeded row's draw is then keyed by (seed, stream, position)."""
        noise = torch.empty(len(rows), like.shape[1], dtype=torch.float32, device=like.device)
        unseeded = [j for j, row in enumerate(rows) if row.params.seed is None]
        if unseeded:
            drawn = torch.empty(len(unseeded), like.shape[1], dtype=torch.float32, device=like.device)
            drawn.exponential_(generator=self._unseeded_generator(like.device))
            noise[_index(unseeded, like)] = drawn
        for j, generator in self._seeded_generators(rows, like.device, stream):
            noise[j].exponential_(generator=generator)
        # Exp(1) can round to exactly 0; p / 0 is inf (or NaN for a filtered p == 0), which would win.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def uniforms(self, rows: Sequence[SamplingRow], device: torch.device, stream: int) -> torch.Tensor:
        """One U[0, 1) draw per row, from the same sources as `exponential_noise` (keyed by `stream`)."""
        out = torch.rand(len(rows), generator=self._unseeded_generator(device), device=device)
        for j, generator in self._seeded_generators(rows, device, stream):
            out[j] = torch.rand(1, generator=generator, device=device)[0]
        return out

    def _seeded_generators(self, rows: Sequence[SamplingRow], device: torch.device, stream: int):
        """(row index, the scratch generator re-seeded for that row) for every seeded row, in order."""
        scratch = self._scratch_generator(device)
        for j, row in enumerate(rows):
            if row.params.seed is not None:
                scratch.manual_seed(row_generator_seed(row.params.seed ^ stream, row.position))
                yield j, scratch

    def _unseeded_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._unseeded:
            self._unseeded[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._unseeded[device]

    def _scratch_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._scratch:
            self._scratch[device] = torch.Generator(device=device)
        return self._scratch[device]


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.greedy
        and not p.adjusts_logits
        and not row.masks_stop_ids
        and p.logprobs is None
        and row.grammar_bitmask is None
    )


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Step 5's logprobs of `token_ids` (one per row) under the raw `logits`; None where not asked."""
    result: list[TokenLogprobs | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return result
    index = _index(wanted, logits)
    found = raw_logprobs(logits[index], token_ids[index], [rows[i].params.logprobs or 0 for i in wanted])
    for i, entry in zip(wanted, found, strict=True):
        result[i] = entry
    return result


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_counts: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of `logits`: the logprob of `token_ids[row]` and the `top_counts[row]` most likely tokens,
    all under log_softmax of the raw logits (step 5)."""
    raw = logits.to(torch.float32).log_softmax(dim=-1)
    chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    best = raw.topk(min(max(top_counts), raw.shape[1]), dim=-1)
    top_values, top_ids = best.values.tolist(), best.indices.tolist()
    return [
        TokenLogprobs(sampled_logprob=chosen[j], top=tuple(zip(top_ids[j][:n], top_values[j][:n], strict=True)))
        for j, n in enumerate(top_counts)
    ]


def _index(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)
