"""logit_bias end to end on the engine: greedy output equals HF `generate` with the same biases
(`sequence_bias` of one-token sequences), with and without a repetition penalty, plain and speculative
(both proposers, tiny blocks); a bias of +100 forces its token under sampling too."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine import SamplingParams
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

BLOCKS = 512


def _biases(plain: list[list[int]]) -> dict[int, float]:
    """Ban the tokens the unbiased engine picks first and favour a few others: the output must change."""
    banned = {tokens[0]: -100.0 for tokens in plain}
    return {**banned, 17: 2.5, 101: 1.5, 250: -0.5}


def _tokens(llm, prompts, params) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_with_logit_bias_equals_hf_sequence_bias(penalty, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = random_prompts(3, 5, 30, 512, seed=61)
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=BLOCKS)
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=penalty)
    plain = _tokens(llm, prompts, base)
    bias = _biases(plain)
    got = _tokens(llm, prompts, replace(base, logit_bias=bias))
    expected = hf_greedy_generate(model_dir, prompts, 12, repetition_penalty=penalty,
                                  sequence_bias=[[[token], value] for token, value in bias.items()])
    assert got == expected
    assert got != plain and not any(token in bias and bias[token] < -50 for out in got for token in out)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_applies_the_bias_as_plain_decoding_does(method, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = [p + p[: len(p) // 2] for p in random_prompts(4, 4, 30, 512, seed=62)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    bias = _biases(_tokens(make_llm(model_dir, block_size=2, num_kv_blocks=BLOCKS), prompts, greedy))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias=bias)
    expected = hf_greedy_generate(model_dir, prompts, 16, sequence_bias=[[[t], v] for t, v in bias.items()])
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False} if method == "ngram" else
            {"model": str(checkpoint(TinySpec(num_layers=1, seed=5))), "num_speculative_tokens": 3,
             "adaptive": False})
    llm = make_llm(model_dir, block_size=2, num_kv_blocks=BLOCKS, speculative_config=spec)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == expected
    assert sum(o.metrics.spec_draft_tokens for o in outs) > 0, "nothing was drafted: verification not exercised"


def test_a_bias_of_100_forces_its_token_when_sampling(checkpoint, make_llm):
    llm = make_llm(checkpoint(TinySpec()), block_size=4, num_kv_blocks=BLOCKS)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7, logit_bias={42: 100.0})
    assert _tokens(llm, random_prompts(2, 5, 20, 512, seed=63), params) == [[42] * 10] * 2
