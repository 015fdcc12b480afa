"""Verification: which drafts the target accepts, and the one token it adds after them.

A sequence with drafts d_1..d_k has k + 1 rows of target logits: row j (0-based) is the distribution of
the token after d_1..d_j. Rows are processed exactly as the sampler would process them at that position
(penalties and min_tokens see d_1..d_j as output; seeded draws are keyed by the row's position).

- Greedy rows (temperature 0): x_j = the sampler's argmax of row j. Accept the longest prefix with
  d_{j+1} == x_j (`matching_prefix`), then emit x_a (the target's own next token): the output equals
  plain greedy decoding. The decoder does this over one batched argmax of every greedy sequence.
- Random rows, the standard rejection-sampling rule (Leviathan et al., Chen et al.): accept d_{j+1} with
  probability min(1, p_j(d) / q_j(d)), p = the target's processed distribution, q = the draft's
  (one-hot for a deterministic proposal such as n-gram or a greedy draft). At the first rejection emit
  a sample of norm(max(0, p_j - q_j)) and stop; when all k are accepted emit a bonus sample of p_k.
  Every emitted token is then distributed exactly as the target's own sampling would be.

Draws: the acceptance uniform of row j and its residual/bonus noise come from the sampler's sources
(`Sampler.uniforms` / `exponential_noise`): a seeded request's draws are keyed by (seed, stream,
position) and replay identically on every path; the bonus draw is the sampler's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampler import Sampler, SamplingRow, processed_logits

ACCEPT_STREAM = 0x5EC_ACCE7  # seeds the acceptance uniforms, independent of the sampling noise
RESIDUAL_STREAM = 0x5EC_2E51D  # seeds a rejection's resample


@dataclass(frozen=True)
class Drafts:
    """One sequence's proposal: tokens, and the draft's distribution per token (`[k, vocab]`), or None
    when the proposal is deterministic (q is one-hot at each token)."""

    token_ids: tuple[int, ...]
    probs: torch.Tensor | None = None


def verify(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Drafts) -> list[int]:
    """The tokens one sequence with random (temperature > 0) rows emits this step: accepted drafts,
    then one target token (>= 1 token). `logits`: its `len(drafts) + 1` rows of raw target logits;
    `rows`: their sampling rows. Greedy rows need no draws: the decoder takes every greedy sequence's
    argmax in one batched call and accepts `matching_prefix` of it."""
    assert not rows[0].params.greedy, "greedy verification is matching_prefix over the batched argmax"
    k = len(drafts.token_ids)
    probs = processed_logits(logits, rows).softmax(dim=-1)
    draft_ids = torch.tensor(drafts.token_ids, dtype=torch.long, device=probs.device)
    p_draft = probs[:k].gather(1, draft_ids[:, None]).squeeze(1)
    q_draft = (
        torch.ones_like(p_draft)
        if drafts.probs is None
        else drafts.probs.to(probs.device).gather(1, draft_ids[:, None]).squeeze(1)
    )
    uniforms = sampler.uniforms(rows[:k], probs.device, ACCEPT_STREAM)
    accepted_mask = (uniforms * q_draft < p_draft).tolist()
    accepted = accepted_mask.index(False) if False in accepted_mask else k
    if accepted == k:  # every draft accepted: the bonus token is the sampler's own draw at this position
        noise = sampler.exponential_noise(rows[k:], probs)
        return [*drafts.token_ids, int((probs[k] / noise[0]).argmax())]
    residual = _residual(probs[accepted], drafts, accepted)
    noise = sampler.exponential_noise(rows[accepted : accepted + 1], probs, RESIDUAL_STREAM)
    return [*drafts.token_ids[:accepted], int((residual / noise[0]).argmax())]


def _residual(p: torch.Tensor, drafts: Drafts, index: int) -> torch.Tensor:
    """norm(max(0, p - q)); unnormalised is fine for the exponential race."""
    if drafts.probs is None:
        residual = p.clone()
        residual[drafts.token_ids[index]] = 0.0
    else:
        residual = (p - drafts.probs[index].to(p.device)).clamp_min_(0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: any sample of p is exact
        return p
    return residual


def matching_prefix(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many drafts equal the target's picks, from the first on (greedy acceptance)."""
    for index, token in enumerate(drafts):
        if targets[index] != token:
            return index
    return len(drafts)
