"""The synchronous `Cluster` handle: streaming, bad input named by field, and the cluster keeps serving."""
from __future__ import annotations

import pytest

from cluster.api import Cluster
from cluster.client import RequestFailed
from common.config import ClusterConfig, PoolConfig
from engine import SamplingParams
from tests.factories import TinySpec, hf_greedy_generate, random_prompts


def test_sync_cluster_streams_tokens_and_names_bad_fields(checkpoint, ray_session):
    model_dir = checkpoint(TinySpec())
    pool = PoolConfig(num_cpus=0.5, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(2, 5, 30, 512, seed=71)
    with Cluster(ClusterConfig(prefill=pool, decode=pool), str(model_dir)) as cluster:
        chunks = list(cluster.generate(prompts[0], greedy))
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
        with pytest.raises(RequestFailed) as err:
            cluster.generate_tokens([1, 2, 99999], greedy)
        assert err.value.field == "prompt_token_ids" and not err.value.unavailable
        with pytest.raises(RequestFailed) as err:
            cluster.generate_tokens([3] * 600, greedy)  # over the model's 512 positions
        assert err.value.field == "prompt"
        got = [[t for c in chunks for t in c.token_ids], cluster.generate_tokens(prompts[1], greedy)]
        assert got == hf_greedy_generate(model_dir, prompts, 8)
        import ray

        for report in ray.get([cluster.launched.prefill[0].actor.check_integrity.remote(),
                               cluster.launched.decode[0].actor.check_integrity.remote()]):
            assert report["num_free_blocks"] == report["num_blocks"] and report["num_sequences"] == 0
