"""The tiny-checkpoint factories and the HF greedy reference the engine is judged against."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from tests.factories import (
    ARCHITECTURES,
    TinySpec,
    hf_greedy_generate,
    make_tiny_checkpoint,
    random_prompts,
)

hf_logging.disable_progress_bar()


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_arch_reloads_with_transformers(tmp_path, arch):
    make_tiny_checkpoint(tmp_path, TinySpec(arch=arch))
    assert AutoConfig.from_pretrained(tmp_path).model_type == arch
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    saved = _tensors(tmp_path)
    for name, param in model.state_dict().items():
        assert torch.equal(param, saved[name]), name
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "Prefill here, decode there — naïve café 42."
    ids = tok.encode(text)
    assert max(ids) < model.config.vocab_size and tok.decode(ids) == text


def test_architecture_specific_weights(tmp_path):
    keys = {}
    for arch in ARCHITECTURES:
        make_tiny_checkpoint(tmp_path / arch, TinySpec(arch=arch))
        keys[arch] = _tensors(tmp_path / arch)
    qwen2_bias = keys["qwen2"]["model.layers.0.self_attn.q_proj.bias"]
    assert qwen2_bias.abs().sum() > 0  # random, not HF's zero init, so a dropped bias shows
    assert "model.layers.0.self_attn.q_proj.bias" not in keys["llama"]
    assert "model.layers.0.self_attn.q_norm.weight" in keys["qwen3"]
    assert "model.layers.0.self_attn.q_norm.weight" not in keys["llama"]
    norm = keys["llama"]["model.layers.0.input_layernorm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))
    assert _config(tmp_path / "mistral")["sliding_window"] is None
    assert "head_dim" not in _config(tmp_path / "qwen2")  # implied, like real Qwen2 configs


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_head_layouts(tmp_path, num_kv_heads):
    spec = TinySpec(num_heads=4, num_kv_heads=num_kv_heads, head_dim=16, hidden_size=64)
    make_tiny_checkpoint(tmp_path, spec)
    weights = _tensors(tmp_path)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (num_kv_heads * 16, 64)
    assert weights["model.layers.0.self_attn.v_proj.weight"].shape == (num_kv_heads * 16, 64)
    assert _config(tmp_path)["num_key_value_heads"] == num_kv_heads


def test_head_dim_independent_of_hidden_size(tmp_path):
    make_tiny_checkpoint(tmp_path, TinySpec(num_heads=4, head_dim=32, hidden_size=64))
    assert _tensors(tmp_path)["model.layers.0.self_attn.o_proj.weight"].shape == (64, 4 * 32)
    assert _config(tmp_path)["head_dim"] == 32


def test_sharded_checkpoint_has_index_and_same_weights(tmp_path):
    make_tiny_checkpoint(tmp_path / "one", TinySpec())
    make_tiny_checkpoint(tmp_path / "many", TinySpec(sharded=True))
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((tmp_path / "many" / shard).exists() for shard in shards)
    assert not (tmp_path / "many" / "model.safetensors").exists()
    one, many = _tensors(tmp_path / "one"), _tensors(tmp_path / "many")
    assert one.keys() == many.keys() == index["weight_map"].keys()
    assert all(torch.equal(one[name], many[name]) for name in one)


@pytest.mark.parametrize("dtype,stored", [("bfloat16", "BF16"), ("float16", "F16"), ("float32", "F32")])
def test_dtype_is_what_is_stored(tmp_path, dtype, stored):
    make_tiny_checkpoint(tmp_path, TinySpec(dtype=dtype))
    with safe_open(tmp_path / "model.safetensors", framework="pt") as handle:
        assert {handle.get_slice(name).get_dtype() for name in handle.keys()} == {stored}
    assert _config(tmp_path)["dtype"] == dtype


def test_tied_embeddings_store_no_lm_head(tmp_path):
    make_tiny_checkpoint(tmp_path, TinySpec(tie_word_embeddings=True))
    assert "lm_head.weight" not in _tensors(tmp_path)
    assert _config(tmp_path)["tie_word_embeddings"] is True


def test_same_spec_same_bytes_and_seed_changes_weights(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        make_tiny_checkpoint(tmp_path / name, TinySpec(seed=seed))
    read = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert read["a"] == read["b"] != read["c"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_reference_is_batch_invariant(tmp_path, arch):
    make_tiny_checkpoint(tmp_path, TinySpec(arch=arch))
    for seed in (1, 2):
        prompts = random_prompts(5, 1, 24, vocab_size=512, seed=seed)
        batched = hf_greedy_generate(tmp_path, prompts, max_new_tokens=12)
        assert [len(out) for out in batched] == [12] * 5
        assert hf_greedy_generate(tmp_path, prompts, max_new_tokens=12, batch_size=1) == batched
    # A reference that only emits one token would pass the above; random weights should not.
    assert len({tok for out in batched for tok in out}) > 12


@pytest.mark.parametrize(
    "spec",
    [
        TinySpec(num_kv_heads=1, tie_word_embeddings=True),
        TinySpec(arch="qwen3", num_kv_heads=4, dtype="bfloat16"),
        TinySpec(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ],
    ids=["mqa-tied", "qwen3-mha-bf16", "rope-linear"],
)
def test_greedy_reference_is_batch_invariant_on_variants(tmp_path, spec):
    make_tiny_checkpoint(tmp_path, spec)
    prompts = random_prompts(4, 2, 30, vocab_size=spec.vocab_size, seed=3)
    batched = hf_greedy_generate(tmp_path, prompts, max_new_tokens=10, batch_size=2)
    assert batched == hf_greedy_generate(tmp_path, prompts, max_new_tokens=10, batch_size=1)


def test_rope_scaling_is_saved_and_changes_tokens(tmp_path):
    scaling = {"rope_type": "linear", "factor": 4.0}
    make_tiny_checkpoint(tmp_path / "plain", TinySpec())
    make_tiny_checkpoint(tmp_path / "scaled", TinySpec(rope_scaling=scaling))
    rope = _config(tmp_path / "scaled")["rope_parameters"]
    assert rope["rope_type"] == "linear" and rope["factor"] == 4.0 and rope["rope_theta"] == 10000.0
    prompts = random_prompts(3, 20, 30, vocab_size=512, seed=4)
    plain = hf_greedy_generate(tmp_path / "plain", prompts, max_new_tokens=8)
    assert hf_greedy_generate(tmp_path / "scaled", prompts, max_new_tokens=8) != plain


def test_greedy_reference_ignores_eos(tmp_path):
    make_tiny_checkpoint(tmp_path, TinySpec())
    prompts = random_prompts(2, 5, 10, vocab_size=512, seed=5)
    before = hf_greedy_generate(tmp_path, prompts, max_new_tokens=8)
    # Declare the first generated token to be EOS: a reference that honoured EOS would stop there.
    eos = before[0][0]
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((tmp_path / name).read_text())
        (tmp_path / name).write_text(json.dumps({**saved, "eos_token_id": eos}))
    assert hf_greedy_generate(tmp_path, prompts, max_new_tokens=8) == before


def test_random_prompts_deterministic_and_in_range():
    prompts = random_prompts(20, 3, 9, vocab_size=100, seed=7)
    assert prompts == random_prompts(20, 3, 9, vocab_size=100, seed=7)
    assert prompts != random_prompts(20, 3, 9, vocab_size=100, seed=8)
    assert all(3 <= len(p) <= 9 for p in prompts)
    assert {len(p) for p in prompts} != {len(prompts[0])}
    flat = [tok for p in prompts for tok in p]
    assert min(flat) >= 4 and max(flat) < 100  # ids 0-3 are bos/eos/pad/turn


def test_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="known: .*llama"):
        TinySpec(arch="gpt2")
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinySpec(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        TinySpec(vocab_size=128)
