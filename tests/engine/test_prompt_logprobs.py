"""Prompt logprobs (`SamplingParams.prompt_logprobs`): every prompt token after the first scored under
the model given the tokens before it, equal to HF's forward pass over the prompt (fp32, within 1e-4),
whether the prompt runs in one chunk or many, behind a preemption, after its prefix was cached, or in
a speculative engine; the output tokens stay HF's; bad values are named."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from tests.factories import TinySpec, hf_greedy_generate, hf_prompt_logprobs, random_prompts

TOP = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=TOP)
BLOCKS = 512


def assert_matches_hf(entries, reference: torch.Tensor, prompt: list[int]) -> None:
    assert entries[0] is None and len(entries) == len(prompt)
    for p, entry in enumerate(entries[1:]):
        want = reference[p]
        assert abs(entry.sampled_logprob - want[prompt[p + 1]].item()) < 1e-4, p
        values = want.topk(TOP)
        assert len(entry.top) == TOP
        assert torch.allclose(torch.tensor([v for _, v in entry.top]), values.values, atol=1e-4)
        for (token, value), ref_value in zip(entry.top, values.values.tolist()):
            assert abs(want[token].item() - value) < 1e-4 and abs(value - ref_value) < 1e-4


@pytest.mark.parametrize("chunk_tokens", [None, 8])
def test_prompt_logprobs_equal_hf_forward_in_one_chunk_or_many(chunk_tokens, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = random_prompts(3, 2, 40, 512, seed=71)
    extra = {} if chunk_tokens is None else {"prefill_chunk_tokens": chunk_tokens}
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=BLOCKS, **extra)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    for out, prompt in zip(outs, prompts):
        assert_matches_hf(out.prompt_logprobs, hf_prompt_logprobs(model_dir, prompt), prompt)
    assert [list(o.token_ids) for o in outs] == hf_greedy_generate(model_dir, prompts, 6)
    single = llm.generate([[7]], PARAMS, use_tqdm=False)[0]
    assert single.prompt_logprobs == (None,)  # a one-token prompt has nothing to score
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs is None


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompt = random_prompts(1, 30, 30, 512, seed=72)[0]
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=BLOCKS)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], plain, use_tqdm=False)  # caches the prompt's blocks
    again = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert_matches_hf(again.prompt_logprobs, hf_prompt_logprobs(model_dir, prompt), prompt)
    assert llm.generate([prompt], plain, use_tqdm=False)[0].num_cached_tokens > 0  # others still hit


def test_preemption_mid_prompt_records_each_position_once(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = random_prompts(4, 40, 60, 512, seed=73)
    # 40 blocks of 4 tokens, chunks of 8: four prompts of 40-60 tokens cannot all stay resident.
    engine = make_llm(model_dir, block_size=4, num_kv_blocks=40, prefill_chunk_tokens=8).engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    preempted_mid_prompt = False
    while engine.has_unfinished():
        engine.step()
        preempted_mid_prompt |= any(
            seq.num_preemptions and seq.num_output_tokens == 0 and 1 < len(seq.prompt_logprobs) for seq in seqs
        )
    for seq in seqs:
        engine.pop_finished(seq.seq_id)
    assert preempted_mid_prompt, "no sequence was preempted with part of its prompt scored"
    for seq, prompt in zip(seqs, prompts):
        assert_matches_hf(seq.prompt_logprobs, hf_prompt_logprobs(model_dir, prompt), prompt)
    assert [seq.output_token_ids for seq in seqs] == hf_greedy_generate(model_dir, prompts, 12)


def test_a_speculative_engine_returns_them_too(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = [p + p[: len(p) // 2] for p in random_prompts(3, 6, 30, 512, seed=74)]
    llm = make_llm(model_dir, block_size=2, num_kv_blocks=BLOCKS, prefill_chunk_tokens=8,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=TOP)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == hf_greedy_generate(model_dir, prompts, 16)
    assert sum(o.metrics.spec_draft_tokens for o in outs) > 0
    for out, prompt in zip(outs, prompts):
        assert_matches_hf(out.prompt_logprobs, hf_prompt_logprobs(model_dir, prompt), prompt)


@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_bad_values_are_named(value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=value)
    assert err.value.field == "prompt_logprobs"


def test_a_resumed_request_computes_none_and_reads_the_cache(checkpoint, make_llm):
    """A request resumed after output tokens (a migration) returned its prompt logprobs with its first
    attempt: the engine computes none for it, and its prefix-cache hits count as usual."""
    model_dir = checkpoint(TinySpec())
    prompt = random_prompts(1, 30, 30, 512, seed=75)[0]
    expected = hf_greedy_generate(model_dir, [prompt], 8)[0]
    engine = make_llm(model_dir, block_size=4, num_kv_blocks=BLOCKS).engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP)
    engine.add_request("first", prompt, params)
    while engine.has_unfinished():
        engine.step()
    engine.pop_finished("first")
    seq = engine.add_request("resumed", prompt, params, output_token_ids=expected[:3])
    while engine.has_unfinished():
        engine.step()
    engine.pop_finished("resumed")
    assert seq.output_token_ids == expected and seq.prompt_logprobs == [None] and seq.num_cached_tokens > 0
