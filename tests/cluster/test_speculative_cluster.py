"""Speculative decoding on the decode pool of a real disaggregated cluster: greedy equals HF, seeded
sampling (with and without a JSON schema) equals the colocated speculative engine, with TP=2 decode and
a draft model whose prompt KV the decode side computes; worker stats carry the counters; no block leaks
on either side."""
from __future__ import annotations

import json

import jsonschema
import pytest

from common.config import PoolConfig
from engine import SamplingParams
from engine.structured.spec import StructuredOutputSpec
from engine.tokenizer import load_tokenizer
from tests.cluster.conftest import run
from tests.cluster.test_disaggregated import GREEDY, SMALL_POOL, _assert_clean, _generate_all, cluster_factory  # noqa: F401
from tests.engine.test_structured_outputs import SCHEMA
from tests.factories import TinySpec, hf_greedy_generate, random_prompts


def _repeating(n: int, seed: int) -> list[list[int]]:
    return [p + p for p in random_prompts(n, 4, 30, 512, seed=seed)]


@pytest.mark.parametrize("method, tp_size", [("ngram", 1), ("draft", 2)])
def test_speculative_decode_pool_is_exact(method, tp_size, checkpoint, cluster_factory, make_llm):  # noqa: F811
    import ray

    model_dir = checkpoint(TinySpec(num_heads=4, num_kv_heads=2))
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False} if method == "ngram" else
            {"model": str(checkpoint(TinySpec(num_layers=1, seed=5))), "num_speculative_tokens": 3,
             "adaptive": False})
    decode = PoolConfig(**{**SMALL_POOL.__dict__, "tp_size": tp_size, "speculative_config": spec})
    cluster = cluster_factory(model_dir, decode=decode, block_size=4)
    prompts = _repeating(4, seed=71)
    assert run(_generate_all(cluster, prompts)) == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    seeded = [SamplingParams(temperature=0.8, seed=300 + i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    colocated = make_llm(model_dir, block_size=4, num_kv_blocks=256, speculative_config=spec)
    expected = [list(o.token_ids) for o in colocated.generate(prompts, seeded, use_tqdm=False)]
    assert run(_generate_all(cluster, prompts, seeded, prefix="seeded")) == expected
    stats = ray.get(cluster.decode[0].actor.stats.remote(), timeout=30)
    assert stats.spec.draft_tokens > 0 and stats.spec.accepted_tokens <= stats.spec.draft_tokens
    assert method == "ngram" or stats.spec.accepted_tokens > 0  # random prompts: prompt lookup rarely hits
    # Structured outputs: drafts are verified under the grammar (rejected where it forbids them); the
    # seeded outputs equal the colocated speculative engine's and validate.
    schema = StructuredOutputSpec.json_schema(SCHEMA)
    structured = [SamplingParams(temperature=1.0, seed=600 + i, max_tokens=120, structured_output=schema)
                  for i in range(len(prompts))]
    expected = [list(o.token_ids) for o in colocated.generate(prompts, structured, use_tqdm=False)]
    outputs = run(_generate_all(cluster, prompts, structured, prefix="structured"))
    assert outputs == expected
    tokenizer = load_tokenizer(model_dir)
    for tokens in outputs:
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)
    _assert_clean(cluster)
