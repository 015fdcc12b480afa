"""Speculative decoding on CUDA: verify steps are decode rows, replayed from CUDA graphs, and greedy
fp32 output stays token-for-token HF's (and the plain engine's) for both proposers."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

pytestmark = pytest.mark.cuda
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
DRAFT = TinySpec(num_layers=1, seed=5)  # same vocabulary, different weights: accepts some drafts


def _repeating_prompts(n: int, seed: int) -> list[list[int]]:
    return [p + p[: len(p) // 2] for p in random_prompts(n, 4, 40, 512, seed=seed)]


def _spec(method: str, checkpoint, model_dir) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    if method == "self-draft":  # accepts everything: every step is a full verify chunk
        return {"model": str(model_dir), "num_speculative_tokens": 4, "adaptive": False}
    return {"model": str(checkpoint(DRAFT)), "num_speculative_tokens": 4, "adaptive": False}


@pytest.mark.parametrize("method", ["ngram", "draft", "self-draft"])
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_fp32_speculation_equals_hf_on_cuda(method, cuda_graphs, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(num_heads=4, num_kv_heads=2, tie_word_embeddings=True))
    prompts = _repeating_prompts(6, seed=12)
    expected = hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens, device="cuda")
    llm = make_llm(model_dir, device="cuda", cuda_graphs=cuda_graphs, block_size=4, num_kv_blocks=256,
                   speculative_config=_spec(method, checkpoint, model_dir))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == expected
    counters = llm.engine.spec.counters
    assert counters.draft_tokens > 0
    if method == "ngram":
        assert counters.accepted_tokens > 0
    if method == "self-draft":
        assert counters.accepted_tokens == counters.draft_tokens
    graphs = llm.engine.runner.graphs
    if cuda_graphs:  # verify steps (up to 6 x 5 rows) replayed graphs wider than plain decoding's 8
        assert max(size for size, count in graphs.replays.items() if count) > 8
    else:
        assert graphs is None


def test_fp32_speculation_with_batch_changes_equals_plain_on_cuda(checkpoint, make_llm):
    """Sequences finish at different lengths, so verify steps mix row counts and padded graph sizes."""
    model_dir = checkpoint(TinySpec(seed=21))
    prompts = _repeating_prompts(9, seed=22)
    params = [SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    plain = make_llm(model_dir, device="cuda", num_kv_blocks=256)
    spec = make_llm(model_dir, device="cuda", num_kv_blocks=256, speculative_config=_spec("ngram", checkpoint, None))
    want = [list(o.token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [list(o.token_ids) for o in spec.generate(prompts, params, use_tqdm=False)] == want
