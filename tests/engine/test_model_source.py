"""Models by Hub id: a checkpoint in a Hugging Face cache layout the test writes (refs, snapshots) is
found offline through HF_HUB_CACHE or HF_HOME, by branch, tag or commit, serves the same tokens as
its folder, and sets what `splitserve serve` serves it as; a missing one fails in one line naming
where it looked and how to fetch it."""
from __future__ import annotations

import hashlib
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.model_source import hub_cache_dir, is_hub_id, resolve_model
from splitserve.serve import build_config, parser
from tests.factories import TinySpec

COMMIT = hashlib.sha1(b"a snapshot").hexdigest()  # the Hub cache names snapshots by 40-hex revision


def _hub_cache(root, model_dir, repo_id: str = "tiny-org/tiny-llama", tag: str = "v1"):
    """`root` as a hub cache holding `model_dir` as the snapshot COMMIT, the target of refs main and `tag`."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    for ref in ("main", tag):
        (repo / "refs" / ref).write_text(COMMIT)
    return repo / "snapshots" / COMMIT


def test_hub_id_resolves_through_the_cache_and_serves_the_same_tokens(checkpoint, tmp_path, monkeypatch):
    model_dir = checkpoint(TinySpec(seed=8))
    snapshot = _hub_cache(tmp_path / "hub", model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for revision in (None, "main", "v1", COMMIT):
        assert resolve_model("tiny-org/tiny-llama", revision) == snapshot
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    by_id = LLM("tiny-org/tiny-llama", progress=False, num_kv_blocks=32).generate([[5, 6, 7]], params, use_tqdm=False)
    by_dir = LLM(model_dir, progress=False, num_kv_blocks=32).generate([[5, 6, 7]], params, use_tqdm=False)
    assert list(by_id[0].token_ids) == list(by_dir[0].token_ids)


def test_hf_home_is_read_when_hf_hub_cache_is_unset(checkpoint, tmp_path, monkeypatch):
    snapshot = _hub_cache(tmp_path / "home" / "hub", checkpoint(TinySpec(seed=8)))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    assert resolve_model("tiny-org/tiny-llama") == snapshot


def test_a_missing_model_or_revision_says_where_it_looked_and_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^model: 'Qwen/Qwen3-30B-A3B' \(revision main\) is not in the "
                                          rf"Hugging Face cache at {tmp_path} .*`hf download Qwen/Qwen3-30B-A3B`"):
        resolve_model("Qwen/Qwen3-30B-A3B")
    with pytest.raises(ConfigError, match="`hf download Qwen/Qwen3-30B-A3B --revision v2`"):
        resolve_model("Qwen/Qwen3-30B-A3B", "v2")
    assert resolve_model(str(tmp_path / "nowhere")) == tmp_path / "nowhere"  # a path: its loader names the gap
    with pytest.raises(ConfigError, match=r"^model_revision: 'v2' applies to a Hub id"):
        resolve_model(str(tmp_path), "v2")
    assert is_hub_id("deepseek-ai/DeepSeek-V3") and not is_hub_id(str(tmp_path)) and not is_hub_id("a/b/c")


def test_serve_flags_resolve_the_id_and_set_served_names_and_max_len(checkpoint, tmp_path, monkeypatch):
    snapshot = _hub_cache(tmp_path / "hub", checkpoint(TinySpec(seed=8)))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    args = parser("splitserve serve").parse_args(["--model", "tiny-org/tiny-llama", "--revision", "v1",
                                                  "--max-model-len", "64"])
    config, given = build_config(args)
    assert config.model_dir == given["model_dir"] == str(snapshot)
    assert config.served_model_name == ["tiny-org/tiny-llama"]  # the id, not the snapshot's hash
    assert config.engine_config("decode", config.model_dir).max_model_len == 64
    named = parser("splitserve serve").parse_args(["--model", "tiny-org/tiny-llama", "--served-model-name", "a", "b"])
    assert build_config(named)[0].served_model_name == ["a", "b"]
    missing = parser("splitserve serve").parse_args(["--model", "tiny-org/absent"])
    with pytest.raises(ConfigError, match="hf download tiny-org/absent"):
        build_config(missing)
