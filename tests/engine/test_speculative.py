"""Speculative decoding keeps greedy output exact: equal to HF `generate` and to the engine without
speculation, for both proposers, every head layout, tiny blocks (rollbacks cross block boundaries),
chunked prefill, prefix caching, preemption, stops and max_tokens; a draft equal to the target accepts
everything. `make_llm` checks every pool's integrity and that no block leaked after each test."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.errors import UnsupportedModelError
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LAYOUTS = {
    "gqa-tied": dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "mqa": dict(num_heads=2, num_kv_heads=1, head_dim=32),
}
DRAFT = TinySpec(num_layers=1, seed=5)  # same vocabulary, different weights: accepts some drafts


def _repeating_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds matches (and misses some)."""
    return [p + p[: len(p) // 2] for p in random_prompts(n, 4, 30, 512, seed=seed)]


BLOCKS = 512  # a small pool per engine: the default sizing would allocate (and check) ~100k tiny blocks


def _spec(method: str, checkpoint, k: int = 3, **extra) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "adaptive": False, **extra}
    return {"model": str(checkpoint(DRAFT)), "num_speculative_tokens": k, "adaptive": False, **extra}


def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_greedy_equals_hf_and_plain_engine_with_tiny_blocks(method, layout, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(**LAYOUTS[layout]))
    prompts = _repeating_prompts(5, seed=3)
    expected = hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    plain = _tokens(make_llm(model_dir, block_size=2, num_kv_blocks=BLOCKS), prompts)
    # Chunks of 8: prompts are prefilled, and the draft catches up, over several steps.
    llm = make_llm(model_dir, block_size=2, num_kv_blocks=BLOCKS, prefill_chunk_tokens=8,
                   speculative_config=_spec(method, checkpoint))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == expected == plain
    counters = llm.engine.spec.counters
    assert counters.draft_tokens > 0 and 0 < counters.accepted_tokens < counters.draft_tokens
    assert sum(o.metrics.spec_draft_tokens for o in outs) == counters.draft_tokens
    assert sum(o.metrics.spec_accepted_tokens for o in outs) == counters.accepted_tokens


def test_draft_equal_to_target_accepts_everything(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = random_prompts(4, 3, 40, 512, seed=4)
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=BLOCKS, speculative_config={"model": str(model_dir),
                                                                "num_speculative_tokens": 4, "adaptive": False})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    for out in outs:
        assert out.metrics.spec_acceptance_rate == 1.0
        # 15 tokens after the first, 5 per verify step (4 drafts + bonus): 3 steps
        assert out.metrics.spec_steps == 3 and out.metrics.spec_mean_accepted_length == 5.0


def test_int8_self_draft_agrees_often_and_output_stays_exact(checkpoint, make_llm):
    """The target's own checkpoint, weights quantized to int8 at load, as its draft (self-speculation):
    greedy output is the fp32 target's, and the draft agrees with most of it."""
    model_dir = checkpoint(TinySpec(weight_std=0.02))
    prompts = random_prompts(4, 3, 40, 512, seed=6)
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=BLOCKS, speculative_config={
        "model": str(model_dir), "quantization": "int8", "num_speculative_tokens": 4, "adaptive": False})
    draft_layer = llm.engine.spec.draft.runner.model.model.layers[0].mlp.down_proj
    assert draft_layer.weight.dtype == torch.int8
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    counters = llm.engine.spec.counters
    assert counters.accepted_tokens / counters.draft_tokens > 0.8


def test_chunked_prefill_prefix_caching_and_only_accepted_tokens_hashed(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    system = random_prompts(1, 21, 21, 512, seed=8)[0]
    prompts = [system + p for p in _repeating_prompts(4, seed=9)]
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=BLOCKS, prefill_chunk_tokens=7, max_num_batched_tokens=40,
                   speculative_config=_spec("ngram", checkpoint, k=5))
    first = _tokens(llm, prompts)
    assert first == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    # The finished sequences' blocks (outputs included) are cached: asking again for prompt + output
    # hits them, so every cached block held exactly the tokens hashed into it.
    longer = [p + out[:-1] for p, out in zip(prompts, first)]
    outs = llm.generate(longer, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == hf_greedy_generate(model_dir, longer, GREEDY.max_tokens)
    assert all(o.num_cached_tokens >= 4 * ((len(p) - 1) // 4) - 4 for o, p in zip(outs, longer))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_preemption_keeps_output_exact(method, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = _repeating_prompts(6, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=24, speculative_config=_spec(method, checkpoint))
    engine = llm.engine
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    for seq in seqs:
        engine.pop_finished(seq.seq_id)
    assert sum(seq.num_preemptions for seq in seqs) > 0
    assert [seq.output_token_ids for seq in seqs] == hf_greedy_generate(model_dir, prompts, params.max_tokens)


def test_stops_and_max_tokens_are_never_passed(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = _repeating_prompts(4, seed=14)
    plain_llm = make_llm(model_dir, num_kv_blocks=BLOCKS)
    full = _tokens(plain_llm, prompts)
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=BLOCKS, speculative_config=_spec("draft", checkpoint, k=4))
    for limit in (1, 2, 5):
        short = SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True)
        assert _tokens(llm, prompts, short) == [f[:limit] for f in full]
    stop_id = full[0][6]
    stopped = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id])
    expected = [f[:f.index(stop_id) + 1] if stop_id in f else f for f in full]
    assert _tokens(llm, prompts, stopped) == expected
    text = plain_llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    with_stop = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    plain_out = plain_llm.generate(prompts[:1], with_stop, use_tqdm=False)[0]
    spec_out = llm.generate(prompts[:1], with_stop, use_tqdm=False)[0]
    assert (spec_out.text, spec_out.token_ids) == (plain_out.text, plain_out.token_ids)


def test_logprobs_are_the_targets(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = _repeating_prompts(3, seed=15)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    plain = make_llm(model_dir, num_kv_blocks=BLOCKS).generate(prompts, params, use_tqdm=False)
    spec = make_llm(model_dir, block_size=4, num_kv_blocks=BLOCKS,
                    speculative_config=_spec("draft", checkpoint)).generate(
        prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert y.sampled_logprob == pytest.approx(x.sampled_logprob, abs=1e-4)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]


def test_a_draft_with_another_vocabulary_is_refused_by_name(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    other = checkpoint(TinySpec(vocab_size=640))
    with pytest.raises(UnsupportedModelError, match="speculative_config.model: the draft's vocab_size 640"):
        make_llm(model_dir, speculative_config={"model": str(other)})


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_speculates_like_it_decodes(kv_cache_dtype, checkpoint, make_llm):
    """The draft's cache and the rollback use the engine's KV storage format; greedy output equals the
    same quantized engine without speculation."""
    model_dir = checkpoint(TinySpec())
    prompts = _repeating_prompts(3, seed=16)
    common = dict(block_size=4, num_kv_blocks=BLOCKS, kv_cache_dtype=kv_cache_dtype)
    plain = _tokens(make_llm(model_dir, **common), prompts)
    llm = make_llm(model_dir, **common, speculative_config={"model": str(model_dir), "num_speculative_tokens": 3,
                                                            "adaptive": False})
    assert _tokens(llm, prompts) == plain
    assert llm.engine.spec.draft.runner.kv_cache.fmt.quantized
    assert llm.engine.spec.counters.accepted_tokens > 0.9 * llm.engine.spec.counters.draft_tokens
