"""Sampled speculative decoding draws exactly from the target's distribution (chi-square, p > 0.01),
unit-level against known p and q and end to end on a tiny-vocabulary model; seeded requests replay."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from engine.sampler import Sampler, SamplingRow
from engine.speculative.rejection import Drafts, verify
from tests.factories import TinySpec, random_prompts

VOCAB = 8
TINY = TinySpec(vocab_size=VOCAB, with_tokenizer=False, weight_std=0.1, num_layers=2)
TINY_DRAFT = TinySpec(vocab_size=VOCAB, with_tokenizer=False, weight_std=0.1, num_layers=1, seed=9)
P_VALUE = 0.01


def _rows(n: int, params: SamplingParams) -> list[SamplingRow]:
    return [SamplingRow(params, [3], [0] * j, ()) for j in range(n)]


@pytest.mark.parametrize("deterministic_draft", [True, False])
def test_rejection_sampling_emits_the_target_distribution(deterministic_draft):
    """First emitted token over 2,000 verifications of one draft from q against target p (a residual
    sampled from p instead of max(0, p - q) fails this by p < 1e-6)."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    q = torch.tensor([0.3, 0.1, 0.4, 0.1, 0.1])
    logits = torch.stack([p.log(), p.log()])  # row 0 verifies the draft, row 1 is the bonus row
    sampler, generator = Sampler(seed=1), torch.Generator().manual_seed(2)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(5)
    for _ in range(2000):
        draft = 2 if deterministic_draft else int(torch.multinomial(q, 1, generator=generator))
        drafts = Drafts((draft,), None if deterministic_draft else q[None, :])
        counts[verify(sampler, logits, _rows(2, params), drafts)[0]] += 1
    assert chisquare(counts.numpy(), (p * counts.sum()).numpy()).pvalue > P_VALUE


def _target_marginals(model_dir, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions of output tokens 1 and 2 (marginal over the earlier outputs), from HF."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        def probs(tokens_batch):
            return model(torch.tensor(tokens_batch)).logits[:, -1].softmax(-1)
        p0 = probs([prompt])[0]
        p1 = probs([prompt + [a] for a in range(VOCAB)])  # [a, b]
        p2 = probs([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    joint01 = p0[:, None] * p1
    return joint01.sum(0), (joint01[:, :, None] * p2).sum((0, 1))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_engine_samples_match_the_target_distribution(method, checkpoint, make_llm):
    model_dir = checkpoint(TINY)
    prompt = [3, 5, 3, 5, 0, 1, 2, 3, 4, 5, 6, 7, 3]  # every token occurs: prompt lookup always matches
    spec = ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "adaptive": False}
            if method == "ngram" else
            {"model": str(checkpoint(TINY_DRAFT)), "num_speculative_tokens": 2, "adaptive": False})
    llm = make_llm(model_dir, num_kv_blocks=2048, max_num_seqs=512, speculative_config=spec)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompt] * 800, params, use_tqdm=False)
    counts = torch.zeros(2, VOCAB)
    for completion in outs:
        counts[0, completion.token_ids[1]] += 1
        counts[1, completion.token_ids[2]] += 1
    assert llm.engine.spec.counters.draft_tokens > 800  # the speculative path produced these tokens
    for observed, expected in zip(counts, _target_marginals(model_dir, prompt)):
        assert chisquare(observed.numpy(), (expected * observed.sum()).numpy()).pvalue > P_VALUE


def test_seeded_sampling_replays_in_any_batch(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = random_prompts(4, 4, 20, 512, seed=21)
    seeded = [SamplingParams(temperature=0.9, top_k=50, seed=40 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    spec = {"model": str(checkpoint(TinySpec(num_layers=1, seed=5))), "num_speculative_tokens": 3,
            "adaptive": False}
    together = make_llm(model_dir, num_kv_blocks=512, speculative_config=spec)
    alone = make_llm(model_dir, num_kv_blocks=512, block_size=4, speculative_config=spec)
    batch = [list(o.token_ids) for o in together.generate(prompts, seeded, use_tqdm=False)]
    single = [list(alone.generate([p], s, use_tqdm=False)[0].token_ids) for p, s in zip(prompts, seeded)]
    assert batch == single
    assert together.engine.spec.counters.accepted_tokens > 0
