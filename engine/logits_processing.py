"""Turning one step's raw logits into the distribution each row samples from.

Order of operations; each step touches only the rows that enable it, so neutral parameters cost nothing:

0. structured output: a row with a `grammar_bitmask` (engine/structured/matchers.py) has every token
   its grammar forbids set to -inf. Nothing later can lift a -inf, so the row samples (or, greedy, takes
   the argmax) among the allowed tokens only. Such a row skips step 1: the grammar decides when the
   output may end.
1. min_tokens: while a row has generated fewer than `params.min_tokens` tokens, its
   `stop_ids_for_min_tokens` (EOS ids and `params.stop_token_ids`) are set to -inf so it cannot stop early.
2. logit_bias: each (token id, bias) of `params.logit_bias` is added to that token's logit, as HF's
   `SequenceBiasLogitsProcessor` does for one-token sequences (first among HF's processors, and among
   vLLM's before its penalties: the penalties see the biased logit).
3. repetition_penalty, as HF's `RepetitionPenaltyLogitsProcessor`: each distinct token of prompt + output
   has its logit multiplied by the penalty when negative and divided by it otherwise.
4. presence / frequency penalty, as OpenAI and vLLM define them, over OUTPUT tokens only:
   `logit -= presence_penalty * (count > 0) + frequency_penalty * count`.
5. Greedy rows (temperature == 0) stop here: the sampler takes their argmax, which temperature and the
   filters below could not change.
6. Random rows: divide by temperature, then top-k, top-p and min-p in that order, each with the semantics
   of HF's warper of the same name; filtered logits become -inf.
   - top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are all kept);
   - top-p keeps the smallest highest-probability set whose mass is >= top_p, and always the top token;
   - min-p keeps the tokens whose probability is >= min_p * (the top token's probability).

The float32 arithmetic follows HF step for step (same operations, top-p's cumulative sum taken from the
least likely token up), so kept sets and values match HF's processors bit for bit; tests hold us to it.

Token ids outside [0, vocab) are ignored everywhere: an embedding table may be padded wider than the LM
head, and the model cannot produce those ids, so there is nothing to penalise or mask.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one sequence this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far, before this step
    # EOS ids + params.stop_token_ids; the caller leaves EOS out when params.ignore_eos is set.
    stop_ids_for_min_tokens: tuple[int, ...]
    # Structured output: int32 words, bit t % 32 of word t // 32 set when token t is allowed (step 0).
    grammar_bitmask: torch.Tensor | None = field(default=None, compare=False)

    @property
    def position(self) -> int:
        """Index of the token being sampled among this sequence's outputs."""
        return len(self.output_token_ids)

    @property
    def masks_stop_ids(self) -> bool:
        return (
            self.position < self.params.min_tokens
            and len(self.stop_ids_for_min_tokens) > 0
            and self.grammar_bitmask is None
        )


def check_batch_shape(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Raise ValueError unless `logits` is [len(rows), vocab] with vocab >= 1."""
    if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < 1:
        raise ValueError(f"logits must be [num_rows={len(rows)}, vocab >= 1], got {tuple(logits.shape)}")


def processed_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Logits after min_tokens masking, bias, penalties, temperature, top-k, top-p, min-p (filtered = -inf).

    Returns a new float32 tensor; the caller's `logits` is never written. Greedy rows get steps 1-4 only.
    """
    check_batch_shape(logits, rows)
    x = logits.to(dtype=torch.float32, copy=True)
    _apply_grammar_masks(x, rows)
    _mask_stop_ids(x, rows)
    _apply_logit_bias(x, rows)
    _apply_repetition_penalty(x, rows)
    _apply_presence_frequency_penalty(x, rows)
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if random_rows:
        params = [rows[i].params for i in random_rows]
        index = _index(random_rows, x)
        scaled = x[index] / _column([p.temperature for p in params], x)
        _apply_top_k_top_p(scaled, params)
        _apply_min_p(scaled, params)
        x[index] = scaled
    return x


def _apply_grammar_masks(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    masked = [i for i, row in enumerate(rows) if row.grammar_bitmask is not None]
    if not masked:
        return
    words = torch.stack([rows[i].grammar_bitmask for i in masked])  # type: ignore[misc]
    index = _index(masked, x)
    x[index] = x[index].masked_fill(~_unpack_bits(words, x.shape[1], x.device), float("-inf"))


def _unpack_bits(words: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, words] int32 bitmasks (little-endian bits) as a [rows, vocab_size] bool tensor on `device`."""
    if device.type == "cpu":  # numpy's unpackbits is one pass; torch's shift-and-mask is several
        bits = np.unpackbits(words.numpy().view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
        return torch.from_numpy(bits).bool()
    # On an accelerator the packed words cross (32x smaller than the mask) and are unpacked there.
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((words.to(device).unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()


def _mask_stop_ids(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    masked = [i for i, row in enumerate(rows) if row.masks_stop_ids]
    if not masked:
        return
    owners, token_ids = _owned_token_ids([[rows[i].stop_ids_for_min_tokens] for i in masked], x)
    x[_index(masked, x)[owners], token_ids] = float("-inf")


def _apply_logit_bias(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return
    columns = [_bias_columns(rows[i].params.logit_bias) for i in biased]
    owners = torch.repeat_interleave(_index(biased, x), torch.tensor([len(ids) for ids, _ in columns]).to(x.device))
    token_ids = torch.cat([ids for ids, _ in columns]).to(x.device)
    biases = torch.cat([values for _, values in columns]).to(x.device)
    in_vocab = token_ids < x.shape[1]
    # Ids are unique per row (SamplingParams), so each element gets exactly one float32 addition, as in HF.
    x[owners[in_vocab], token_ids[in_vocab]] += biases[in_vocab]


@functools.lru_cache(maxsize=1024)
def _bias_columns(logit_bias: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's (ids, biases) as tensors, built once: its rows need them every step (1 + k with drafts)."""
    ids, biases = zip(*logit_bias, strict=True)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(biases, dtype=torch.float32)


def _apply_repetition_penalty(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    penalised = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not penalised:
        return
    index = _index(penalised, x)
    scores = x[index]
    seen = torch.zeros_like(scores, dtype=torch.bool)
    history = [[rows[i].prompt_token_ids, rows[i].output_token_ids] for i in penalised]
    seen[_owned_token_ids(history, x)] = True
    penalty = _column([rows[i].params.repetition_penalty for i in penalised], x)
    # Multiplying a negative logit and dividing a positive one both make the token less likely.
    scaled = torch.where(scores < 0, scores * penalty, scores / penalty)
    x[index] = torch.where(seen, scaled, scores)


def _apply_presence_frequency_penalty(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    penalised = [
        i for i, row in enumerate(rows) if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0
    ]
    if not penalised:
        return
    index = _index(penalised, x)
    scores = x[index]
    counts = torch.zeros_like(scores)
    owners, token_ids = _owned_token_ids([[rows[i].output_token_ids] for i in penalised], x)
    counts.index_put_((owners, token_ids), torch.ones_like(token_ids, dtype=counts.dtype), accumulate=True)
    presence = _column([rows[i].params.presence_penalty for i in penalised], x)
    frequency = _column([rows[i].params.frequency_penalty for i in penalised], x)
    x[index] = scores - (presence * (counts > 0).to(counts.dtype) + frequency * counts)


def _apply_top_k_top_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Filter `scores` (temperature-scaled, one row per entry of `params`) in place; one sort serves both."""
    vocab = scores.shape[1]
    chosen = [j for j, p in enumerate(params) if (p.top_k is not None and p.top_k < vocab) or p.top_p < 1.0]
    if not chosen:
        return
    index = _index(chosen, scores)
    rows = scores[index]
    # Ascending, as HF's top-p sorts: summing probability mass in the same order gives the same rounding.
    ascending, order = rows.sort(dim=-1)
    keep_count = [min(params[j].top_k or vocab, vocab) for j in chosen]
    kth_largest = ascending.gather(1, _index([vocab - k for k in keep_count], scores).unsqueeze(1))
    removed = ascending < kth_largest
    cumulative = ascending.masked_fill(removed, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
    # Dropping every token whose cumulative mass (counted from the least likely up) is <= 1 - top_p leaves
    # the smallest top set with mass >= top_p. A row with top_p == 1.0 has top-p off: HF's generate skips
    # the warper there, and running it would drop tokens whose probability underflows to exactly 0.
    top_p_on = _column([params[j].top_p < 1.0 for j in chosen], scores, dtype=torch.bool)
    removed |= top_p_on & (cumulative <= _column([1.0 - params[j].top_p for j in chosen], scores))
    removed[:, -1] = False
    scores[index] = rows.masked_fill(removed.scatter(1, order, removed), float("-inf"))


def _apply_min_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    chosen = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if not chosen:
        return
    index = _index(chosen, scores)
    rows = scores[index]
    probs = rows.softmax(dim=-1)
    # min_p <= 1, so the top token always passes its own threshold: at least one token survives.
    threshold = _column([params[j].min_p for j in chosen], scores) * probs.amax(dim=-1, keepdim=True)
    scores[index] = rows.masked_fill(probs < threshold, float("-inf"))


def _owned_token_ids(
    token_id_seqs: Sequence[Sequence[Sequence[int]]], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ids into (owner, token_id) index tensors: owner r owns every id in token_id_seqs[r].

    Ids outside [0, vocab) are dropped (see the module docstring).
    """
    # numpy converts Python int lists several times faster than torch.as_tensor does.
    chunks = [np.asarray(seq, dtype=np.int64).reshape(-1) for seqs in token_id_seqs for seq in seqs]
    lengths = torch.tensor([sum(len(seq) for seq in seqs) for seqs in token_id_seqs], dtype=torch.long)
    token_ids = torch.from_numpy(np.concatenate(chunks))
    owners = torch.repeat_interleave(torch.arange(len(token_id_seqs)), lengths)
    in_vocab = (token_ids >= 0) & (token_ids < like.shape[1])
    return owners[in_vocab].to(like.device), token_ids[in_vocab].to(like.device)


def _index(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _column(values: Sequence, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row parameters as a [rows, 1] column that broadcasts across the vocab."""
    return torch.tensor(values, dtype=dtype, device=like.device).unsqueeze(1)
