"""The offline API's vLLM-shaped outputs: `.outputs[i]`, `n` completions, special tokens and stop strings
in the text."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.errors import InvalidRequestError
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)


def test_outputs_hold_text_token_ids_and_the_prompt(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    llm = make_llm(model_dir)
    prompts = random_prompts(2, 6, 9, 512, seed=61)
    outs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    for out, prompt, want in zip(outs, prompts, hf_greedy_generate(model_dir, prompts, 10)):
        assert out.prompt_token_ids == tuple(prompt)
        assert len(out.outputs) == 1 and list(out.outputs[0].token_ids) == want
        completion = out.outputs[0]
        assert completion.index == 0 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(want, skip_special_tokens=True)
        assert (out.text, out.token_ids, out.finish_reason) == (completion.text, completion.token_ids, "length")


def test_n_completions_with_a_seed_are_distinct_and_reproducible(checkpoint, make_llm):
    llm = make_llm(checkpoint(TinySpec()))
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True)
    first, again = (llm.generate(["Once upon a time"], params, use_tqdm=False)[0] for _ in range(2))
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({c.token_ids for c in first.outputs}) == 3
    # Completion i is the request seeded seed + i, whatever else runs beside it.
    alone = llm.generate(["Once upon a time"], SamplingParams(seed=8, temperature=1.0, max_tokens=12,
                                                             ignore_eos=True), use_tqdm=False)[0]
    assert alone.token_ids == first.outputs[1].token_ids


def test_skip_special_tokens_false_keeps_them_in_the_text(checkpoint, make_llm):
    llm = make_llm(checkpoint(TinySpec()))
    special = set(llm.tokenizer.all_special_ids)
    # Seeded sampling at a high temperature is close to uniform: special ids turn up in a few outputs.
    hot = dict(temperature=50.0, max_tokens=32, ignore_eos=True)
    prompts = random_prompts(24, 4, 8, 512, seed=62)
    outs = llm.generate(prompts, [SamplingParams(**hot, seed=i) for i in range(24)], use_tqdm=False)
    index = next(i for i, out in enumerate(outs) if special & set(out.token_ids))
    kept = llm.generate([prompts[index]], SamplingParams(**hot, seed=index, skip_special_tokens=False),
                        use_tqdm=False)[0]
    assert kept.token_ids == outs[index].token_ids
    assert kept.text == llm.tokenizer.decode(list(kept.token_ids), skip_special_tokens=False)
    assert outs[index].text == llm.tokenizer.decode(list(kept.token_ids), skip_special_tokens=True)
    assert len(kept.text) > len(outs[index].text)


def test_include_stop_str_in_output(checkpoint, make_llm):
    llm = make_llm(checkpoint(TinySpec()))
    prompt = random_prompts(1, 10, 10, 512, seed=55)[0]
    full = llm.generate([prompt], SamplingParams(**{**GREEDY, "max_tokens": 16}), use_tqdm=False)[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    cut = full.text.index(stop)
    for include, want in ((False, full.text[:cut]), (True, full.text[:cut + len(stop)])):
        params = SamplingParams(**{**GREEDY, "max_tokens": 16}, stop=[stop], include_stop_str_in_output=include)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.text == want


@pytest.mark.parametrize("field,value", [("n", 0), ("n", 1.5), ("skip_special_tokens", "yes"),
                                         ("include_stop_str_in_output", 1)])
def test_bad_new_fields_name_themselves(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def test_priorities_of_the_wrong_length_name_the_field(checkpoint, make_llm):
    llm = make_llm(checkpoint(TinySpec()))
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=1), priorities=[1], use_tqdm=False)
    assert err.value.field == "priorities"
