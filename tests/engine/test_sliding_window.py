"""Sliding-window attention, exact: greedy fp32 tokens equal HF transformers' `generate` on checkpoints
whose windows are far shorter than the prompts and generations (every layer sliding, Mistral; the
layers from max_window_layers on, Qwen2; as `layer_types` lists them, Qwen3), on every engine path:
one-chunk and chunked prefill, prefix-cache hits, the native and PyTorch decode attention, and
speculative verification. Which layers slide follows transformers' own config classes for every
family that has windows, and a window no longer limits the context."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from engine import SamplingParams
from engine.errors import UnsupportedModelError
from engine.model_loader import load_model_config
from tests.factories import TinySpec, hf_greedy_generate, make_tiny_checkpoint, random_prompts

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Checkpoints of three layers with windows of 8-12 tokens; prompts of 30-70 tokens.
WINDOWED = {
    "mistral": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"use_sliding_window": True, "sliding_window": 10,
                        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
}


def windowed_checkpoint(out_dir: Path, name: str) -> Path:
    """A tiny random checkpoint of WINDOWED[name]: the factory's, its config.json given the window.
    Without `layer_types` in the edit, the saved one (all full) is dropped, so both transformers and
    the engine derive the layers from the family's own keys."""
    arch, edits = WINDOWED[name]
    model_dir = make_tiny_checkpoint(out_dir, TinySpec(arch=arch, num_layers=3, seed=7))
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(edits)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """name → (checkpoint dir, prompts, HF's greedy tokens), each built once per module."""
    made: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(name: str):
        if name not in made:
            model_dir = windowed_checkpoint(tmp_path_factory.mktemp(f"window-{name}"), name)
            prompts = random_prompts(4, 30, 70, 512, seed=17)
            made[name] = (model_dir, prompts, hf_greedy_generate(model_dir, prompts, MAX_TOKENS))
        return made[name]

    return get


def _generate(llm, prompts, params=GREEDY):
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _hf_windows(model_type: str, hf_config) -> tuple:
    """Each layer's window as transformers' modeling code reads it: Qwen2/Qwen3/Qwen2-MoE mask a layer
    by its `layer_types` entry; Mistral, Mixtral and Qwen3-MoE mask every layer by `sliding_window`."""
    window = hf_config.sliding_window or None
    if model_type in ("qwen2", "qwen3", "qwen2_moe"):
        return tuple(window if kind == "sliding_attention" else None for kind in hf_config.layer_types)
    return (window,) * hf_config.num_hidden_layers


def _config_dir(root: Path, name: str, hf_config, drop_layer_types: bool) -> Path:
    model_dir = root / name
    hf_config.save_pretrained(model_dir)
    if drop_layer_types:  # transformers and the engine then derive the layers themselves
        raw = json.loads((model_dir / "config.json").read_text())
        raw.pop("layer_types", None)
        (model_dir / "config.json").write_text(json.dumps(raw))
    return model_dir


MOE_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 5, "vocab_size": 64, "max_position_embeddings": 4096, "moe_intermediate_size": 16}
QWEN2_MOE = {**MOE_SHAPE, "architectures": ["Qwen2MoeForCausalLM"], "shared_expert_intermediate_size": 16}
QWEN3_MOE = {**MOE_SHAPE, "architectures": ["Qwen3MoeForCausalLM"]}
MIXTRAL = {**MOE_SHAPE, "architectures": ["MixtralForCausalLM"]}
FAMILY_CONFIGS = {
    "qwen2-moe-sliding": Qwen2MoeConfig(**QWEN2_MOE, use_sliding_window=True, sliding_window=16, max_window_layers=3),
    "qwen2-moe-off": Qwen2MoeConfig(**QWEN2_MOE, use_sliding_window=False, sliding_window=16),
    "qwen3-moe-sliding": Qwen3MoeConfig(**QWEN3_MOE, use_sliding_window=True, sliding_window=16),
    "qwen3-moe-off": Qwen3MoeConfig(**QWEN3_MOE, sliding_window=16),
    "mixtral-sliding": MixtralConfig(**MIXTRAL, sliding_window=16),
    "mixtral-off": MixtralConfig(**MIXTRAL, sliding_window=None),
}


@pytest.mark.parametrize("drop_layer_types", [False, True], ids=["saved-layer-types", "derived"])
@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_moe_family_layers_slide_as_transformers_decides(name, drop_layer_types, tmp_path):
    model_dir = _config_dir(tmp_path, name, FAMILY_CONFIGS[name], drop_layer_types)
    hf_config = AutoConfig.from_pretrained(model_dir)
    ours = load_model_config(model_dir).sliding_windows
    want = _hf_windows(hf_config.model_type, hf_config)
    assert ours == (want if any(want) else ())
    assert load_model_config(model_dir).max_position_embeddings == 4096  # the window no longer caps it


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_dense_layers_slide_as_transformers_decides_and_the_context_is_not_capped(name, tmp_path):
    model_dir = windowed_checkpoint(tmp_path, name)
    hf_config = AutoConfig.from_pretrained(model_dir)
    ours = load_model_config(model_dir)
    assert ours.sliding_windows == _hf_windows(hf_config.model_type, hf_config)
    assert any(w is None for w in ours.sliding_windows) == (name != "mistral")  # Qwen's mix full layers in
    assert ours.max_position_embeddings == hf_config.max_position_embeddings == 512


def test_qwen_without_use_sliding_window_slides_nothing(tmp_path):
    model_dir = windowed_checkpoint(tmp_path, "qwen2")
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "use_sliding_window": False}))
    assert AutoConfig.from_pretrained(model_dir).sliding_window is None
    assert load_model_config(model_dir).sliding_windows == ()


def test_malformed_layer_types_are_refused_naming_the_key(tmp_path):
    model_dir = windowed_checkpoint(tmp_path, "qwen3")
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "layer_types": ["sliding_attention"]}))
    with pytest.raises(UnsupportedModelError, match=r"^layer_types: must list one of"):
        load_model_config(model_dir)


def test_hf_reference_honours_the_window(windowed, tmp_path):
    """Without its window the same checkpoint generates other tokens: the reference below is windowed."""
    model_dir, prompts, expected = windowed("mistral")
    full = Path(shutil.copytree(model_dir, tmp_path / "full"))
    raw = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    assert hf_greedy_generate(full, prompts, MAX_TOKENS) != expected


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_matches_hf_with_one_chunk_prefill_and_native_decode(name, windowed, make_llm):
    model_dir, prompts, expected = windowed(name)
    llm = make_llm(model_dir, block_size=4)
    assert llm.engine.runner.native_decode
    assert _generate(llm, prompts) == expected


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_matches_hf_with_chunked_prefill_and_pytorch_decode(name, windowed, make_llm, monkeypatch):
    """Chunks of 5 tokens each attend to a window reaching back into earlier chunks' blocks."""
    monkeypatch.setenv("SPLITSERVE_ATTENTION", "torch")
    model_dir, prompts, expected = windowed(name)
    llm = make_llm(model_dir, block_size=4, prefill_chunk_tokens=5, max_num_batched_tokens=32)
    assert not llm.engine.runner.native_decode
    assert _generate(llm, prompts) == expected


def test_prefix_cache_hits_keep_output_exact(windowed, make_llm):
    model_dir, _, _ = windowed("qwen2")
    system = random_prompts(1, 40, 40, 512, seed=18)[0]  # five blocks of 8, longer than the window
    prompts = [system + user for user in random_prompts(3, 5, 20, 512, seed=19)]
    expected = hf_greedy_generate(model_dir, prompts, MAX_TOKENS)
    llm = make_llm(model_dir, block_size=8)
    assert _generate(llm, prompts[:1]) == expected[:1]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == expected
    assert [o.num_cached_tokens for o in outs] == [40, 40, 40]


def test_speculative_verification_matches_hf(windowed, make_llm):
    """n-gram drafts verified as decode rows, each attending to its own window."""
    model_dir, prompts, expected = windowed("qwen3")
    llm = make_llm(model_dir, block_size=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False})
    assert _generate(llm, prompts) == expected
    counters = llm.engine.spec.counters
    assert counters.draft_tokens > 0 and counters.accepted_tokens > 0  # verify chunks of several rows ran
