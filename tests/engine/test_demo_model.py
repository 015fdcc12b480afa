"""The generated demo checkpoint: deterministic, loadable offline, and cached safely."""

import functools
import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from engine import demo_model
from engine.demo_model import (
    COMPLETE_MARKER,
    DEMO_MODEL_VERSION,
    demo_model_dir,
    ensure_demo_model,
    write_demo_model,
)

hf_logging.disable_progress_bar()

# Shrinks the model ~300x so determinism and cache tests cost well under a second each.
SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
}
TEXTS = [
    "Prefill reads the prompt; decode writes the reply.",
    "Zürich → São Paulo: ±3 °C, 日本語 😀\n\tx = 1",  # multi-byte text the corpus barely covers
]


def _digests(model_dir) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def full_model(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"), progress=False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    target = tmp_path / "cache" / "demo"
    monkeypatch.setenv("SPLITSERVE_DEMO_MODEL_DIR", str(target))
    small_writer = functools.partial(write_demo_model, config_overrides=SMALL)
    monkeypatch.setattr(demo_model, "write_demo_model", small_writer)
    return target


def test_generation_is_byte_deterministic(tmp_path):
    first = _digests(write_demo_model(tmp_path / "a", progress=False, config_overrides=SMALL))
    assert first == _digests(write_demo_model(tmp_path / "b", progress=False, config_overrides=SMALL))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", COMPLETE_MARKER} == first.keys()
    other_seed = _digests(
        write_demo_model(tmp_path / "c", seed=1, progress=False, config_overrides=SMALL)
    )
    assert other_seed["model.safetensors"] != first["model.safetensors"]
    assert other_seed["tokenizer.json"] == first["tokenizer.json"]


def test_full_model_is_byte_deterministic(full_model, tmp_path):
    assert _digests(write_demo_model(tmp_path, progress=False)) == _digests(full_model)


def test_full_model_shape_and_parameter_count(full_model):
    config = json.loads((full_model / "config.json").read_text())
    marker = json.loads((full_model / COMPLETE_MARKER).read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    heads = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
    assert heads == (12, 4, 64)
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    assert config["vocab_size"] % 64 == 0
    assert 60e6 <= marker["num_parameters"] <= 90e6
    assert marker["version"] == DEMO_MODEL_VERSION


def test_full_model_loads_offline_and_runs(full_model):
    model = AutoModelForCausalLM.from_pretrained(full_model).eval()
    tok = AutoTokenizer.from_pretrained(full_model)
    marker = json.loads((full_model / COMPLETE_MARKER).read_text())
    assert sum(p.numel() for p in model.parameters()) == marker["num_parameters"]
    assert len(tok) <= model.config.vocab_size < len(tok) + 64
    ids = torch.tensor([tok.encode(TEXTS[0])])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()


def test_tokenizer_matches_config_and_round_trips(full_model):
    tok = AutoTokenizer.from_pretrained(full_model)
    config = json.loads((full_model / "config.json").read_text())
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # BPE learned real merges from the corpus: common words are single tokens.
    assert len(tok.encode(" the")) == 1 and len(tok.encode(TEXTS[0])) < len(TEXTS[0]) / 3
    messages = [{"role": "user", "content": "hi"}]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|bos|><|turn|>user\nhi<|eos|><|turn|>assistant\n"
    assert json.loads((full_model / "tokenizer_config.json").read_text())["chat_template"]


def test_demo_model_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("SPLITSERVE_DEMO_MODEL_DIR", raising=False)
    assert demo_model_dir().parts[-3:] == (".cache", "splitserve", f"demo-model-v{DEMO_MODEL_VERSION}")
    monkeypatch.setenv("SPLITSERVE_DEMO_MODEL_DIR", str(tmp_path / "x"))
    assert demo_model_dir() == tmp_path / "x"


def test_ensure_is_idempotent(cache_dir, monkeypatch):
    assert ensure_demo_model() == cache_dir
    before = {p.name: p.stat().st_mtime_ns for p in cache_dir.iterdir()}
    assert COMPLETE_MARKER in before

    def must_not_run(*args, **kwargs):
        raise AssertionError("ensure_demo_model regenerated a complete model")

    monkeypatch.setattr(demo_model, "write_demo_model", must_not_run)
    assert ensure_demo_model() == cache_dir
    assert {p.name: p.stat().st_mtime_ns for p in cache_dir.iterdir()} == before
    # Only the model and its lock file remain next to it: no staging dirs left behind.
    assert sorted(p.name for p in cache_dir.parent.iterdir()) == [".demo.lock", "demo"]


def test_ensure_replaces_incomplete_dir(cache_dir):
    cache_dir.mkdir(parents=True)
    (cache_dir / "config.json").write_text("{truncated")
    ensure_demo_model()
    assert json.loads((cache_dir / "config.json").read_text())["model_type"] == "llama"
    assert (cache_dir / COMPLETE_MARKER).exists()


def test_ensure_yields_to_a_racer_that_finished_first(cache_dir, monkeypatch):
    small_writer = demo_model.write_demo_model
    racer = {}

    def write_then_lose_race(out_dir, **kwargs):
        small_writer(out_dir, **kwargs)
        # Another process completes and installs its copy while we were still writing ours.
        monkeypatch.setattr(demo_model, "write_demo_model", small_writer)
        ensure_demo_model()
        racer["inode"] = cache_dir.stat().st_ino

    monkeypatch.setattr(demo_model, "write_demo_model", write_then_lose_race)
    assert ensure_demo_model() == cache_dir
    assert racer and cache_dir.stat().st_ino == racer["inode"]  # the winner's dir was kept
    assert (cache_dir / COMPLETE_MARKER).exists()
    assert sorted(p.name for p in cache_dir.parent.iterdir()) == [".demo.lock", "demo"]
