"""A quantized KV cache across the disaggregated cluster on real Ray actors: blocks and scales move as
stored from a prefill worker to a TP=2 decode instance, and the output equals the colocated engine's
with the same KV dtype; workers report the quantized sizes and a KV-dtype-qualified identity."""
from __future__ import annotations

import pytest
import torch

from common.config import PoolConfig
from engine.kv_quant import kv_format
from tests.cluster.conftest import run
from tests.cluster.test_disaggregated import GREEDY, SMALL_POOL, _assert_clean, _generate_all, cluster_factory  # noqa: F401
from tests.factories import TinySpec, random_prompts


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_p1d1_decode_tp2_equals_the_colocated_engine_with_the_same_kv_dtype(kv_cache_dtype, checkpoint,
                                                                            cluster_factory, make_llm):
    model_dir = checkpoint(TinySpec(num_heads=4, num_kv_heads=2))
    prompts = random_prompts(5, 2, 60, 512, seed=71)
    cluster = cluster_factory(model_dir, kv_cache_dtype=kv_cache_dtype,
                              decode=PoolConfig(**{**SMALL_POOL.__dict__, "tp_size": 2}))
    info = cluster.prefill[0].info
    assert info.model_identity.endswith(f"/kv-{kv_cache_dtype}")
    assert info.kv_bytes_per_token == kv_format(kv_cache_dtype, torch.float32).bytes_per_token(2, 2, 16)  # 2*2*2*(16+4)
    got = run(_generate_all(cluster, prompts))
    colocated = make_llm(model_dir, kv_cache_dtype=kv_cache_dtype).generate(prompts, GREEDY, use_tqdm=False)
    assert got == [list(o.token_ids) for o in colocated]
    _assert_clean(cluster)
