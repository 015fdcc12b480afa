"""Greedy fp32 tokens equal HF transformers' `generate` on every path: every architecture and head
layout, chunked prefill, prefix-cache hits, and preemption by recompute."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

LAYOUTS = {
    "mha-untied-d16": dict(num_heads=4, num_kv_heads=4, head_dim=16),
    "gqa-tied-d16": dict(num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True),
    "mqa-untied-d32": dict(num_heads=2, num_kv_heads=1, head_dim=32),
    "gqa-untied-d32": dict(num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128),
}


def _params_for(arch: str, layout: dict) -> dict:
    # Qwen2 has no head_dim knob: head_dim * num_heads must equal hidden_size.
    if arch == "qwen2":
        return {**layout, "hidden_size": layout["num_heads"] * layout["head_dim"]}
    return layout


def _generate(llm, prompts, params=GREEDY):
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_matches_hf_for_every_architecture_and_head_layout(arch, layout, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(arch=arch, **_params_for(arch, LAYOUTS[layout])))
    prompts = random_prompts(5, 1, 60, 512, seed=11)
    expected = hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    assert _generate(make_llm(model_dir), prompts) == expected


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}])
def test_matches_hf_with_rope_scaling(rope, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(rope_scaling=rope))
    prompts = random_prompts(3, 20, 90, 512, seed=5)
    assert _generate(make_llm(model_dir), prompts) == hf_greedy_generate(model_dir, prompts, 12)


def test_sharded_checkpoint_matches_hf(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(sharded=True, seed=3))
    assert (model_dir / "model.safetensors.index.json").exists()
    prompts = random_prompts(3, 5, 30, 512, seed=6)
    assert _generate(make_llm(model_dir), prompts) == hf_greedy_generate(model_dir, prompts, 12)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
def test_chunked_prefill_matches_hf(chunk_tokens, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = random_prompts(6, 1, 150, 512, seed=21)
    llm = make_llm(model_dir, prefill_chunk_tokens=chunk_tokens, max_num_batched_tokens=96)
    assert _generate(llm, prompts) == hf_greedy_generate(model_dir, prompts, 12)


def test_prefix_cache_hits_keep_output_exact(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    system = random_prompts(1, 40, 40, 512, seed=31)[0]  # 2.5 blocks of 16: the last one partial
    users = random_prompts(3, 3, 30, 512, seed=32)
    exact_blocks = random_prompts(1, 48, 48, 512, seed=33)[0]  # ends exactly on a block boundary
    prompts = [system + u for u in users] + [users[0], exact_blocks]
    expected = hf_greedy_generate(model_dir, prompts, 12)
    llm = make_llm(model_dir, block_size=16)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == expected
    assert [o.num_cached_tokens for o in outs[:3]] == [32, 32, 32]  # the shared full blocks only
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # every prompt repeated
    assert [list(o.token_ids) for o in again] == expected
    assert again[0].num_cached_tokens == 32 + 16 * ((len(prompts[0]) - 1 - 32) // 16)
    assert again[4].num_cached_tokens == 32  # 48 tokens: the last block is recomputed for logits


def test_preemption_by_recompute_keeps_output_exact(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    prompts = random_prompts(8, 10, 40, 512, seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    preemptions = []
    engine = llm.engine
    original = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preemptions.append(seq.seq_id), original(seq))
    got = _generate(llm, prompts, params)
    assert len(preemptions) > 0, "the tiny pool was meant to force preemption"
    assert got == hf_greedy_generate(model_dir, prompts, 24)


def test_preemption_with_prefix_caching_and_chunking(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(arch="qwen3"))
    prompts = random_prompts(8, 10, 40, 512, seed=42)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=26, prefill_chunk_tokens=7,
                   max_num_batched_tokens=20)
    assert _generate(llm, prompts, params) == hf_greedy_generate(model_dir, prompts, 20)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_serve_and_upcast_exactly(dtype, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(dtype=dtype, seed=4))
    prompts = random_prompts(3, 5, 30, 512, seed=7)
    native = make_llm(model_dir)
    assert native.engine.model_config.dtype == dtype
    assert native.engine.runner.kv_cache.values.dtype == native.engine.model_config.torch_dtype
    outs = native.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    # Loaded as fp32, the half-precision weights are the same numbers HF upcasts: exact again.
    upcast = make_llm(model_dir, dtype="float32")
    assert _generate(upcast, prompts) == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)


def test_chat_applies_the_checkpoint_template(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    llm = make_llm(model_dir)
    conversation = [{"role": "user", "content": "How are blocks cached?"}]
    templated = llm.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    ids = list(templated["input_ids"]) if hasattr(templated, "keys") else list(templated)
    chat = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert list(chat.prompt_token_ids) == ids
    assert list(chat.token_ids) == hf_greedy_generate(model_dir, [ids], GREEDY.max_tokens)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pytorch_attention_path_matches_hf_too(arch, checkpoint, make_llm):
    """The fallback (and reference) decode path, used where the C kernel cannot build or for bf16."""
    model_dir = checkpoint(TinySpec(arch=arch))
    prompts = random_prompts(4, 1, 60, 512, seed=12)
    llm = make_llm(model_dir, prefill_chunk_tokens=7)
    llm.engine.runner.native_decode = False
    assert _generate(llm, prompts) == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
