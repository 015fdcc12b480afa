"""A mixture-of-experts model with latent attention (DeepSeek-V3 shape) served disaggregated on real Ray
actors: a TP=1 prefill worker hands the latent KV over gloo to a TP=2 decode instance whose experts are
split across its ranks (expert parallel) and whose ranks each hold the whole latent; greedy tokens equal
HF's, prefix hits on the prefill worker keep them exact, and every pool ends with all its blocks free.
One cluster, shared by the module's tests (a launch costs seconds of worker start-up); TP-sharded
experts run over real process groups in tests/decode_worker/test_tp_moe.py."""
from __future__ import annotations

import pytest

from cluster.launcher import launch
from common.config import ClusterConfig, PoolConfig
from tests.cluster.conftest import run
from tests.cluster.test_disaggregated import GREEDY, SMALL_POOL, _assert_clean, _generate_all
from tests.factories import hf_greedy_generate, random_prompts
from tests.moe_factories import make_moe_checkpoint, moe_spec

MLA_SPEC = moe_spec("deepseek_v3", num_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                    topk_group=2, first_k_dense_replace=1, q_lora_rank=24, routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def mla_cluster(ray_session, tmp_path_factory):
    model_dir = make_moe_checkpoint(tmp_path_factory.mktemp("mla"), MLA_SPEC)
    decode = PoolConfig(**{**SMALL_POOL.__dict__, "tp_size": 2, "expert_parallel": True})
    cluster = launch(ClusterConfig(prefill=SMALL_POOL, decode=decode, ready_timeout_s=90.0), str(model_dir))
    yield cluster, model_dir
    cluster.shutdown()


def test_mla_moe_hand_off_to_tp2_expert_parallel_decode_equals_hf(mla_cluster):
    cluster, model_dir = mla_cluster
    prompts = random_prompts(5, 1, 50, 512, seed=61)
    assert run(_generate_all(cluster, prompts)) == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    _assert_clean(cluster)


def test_mla_prefix_hits_on_prefill_keep_output_exact(mla_cluster):
    cluster, model_dir = mla_cluster
    system = random_prompts(1, 40, 40, 512, seed=62)[0]
    prompts = [system + p for p in random_prompts(3, 3, 20, 512, seed=63)]
    first = run(_generate_all(cluster, prompts[:1], prefix="warm"))
    again = run(_generate_all(cluster, prompts, prefix="hit"))
    expected = hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    assert first == expected[:1] and again == expected
    _assert_clean(cluster)

