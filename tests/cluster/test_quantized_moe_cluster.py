"""An act-order GPTQ mixture-of-experts checkpoint across the disaggregated cluster on real Ray actors:
one prefill worker and one decode instance of TP=2 (expert parallel), both storing int4 (experts
included, each sorted by its own act-order groups; the decode ranks' o_proj shards hold parts of the
attention's act-order groups). Greedy fp32 tokens equal HF `generate` on the dequantized weights,
fresh and again from the prefill worker's prefix cache."""

from __future__ import annotations

import pytest

from cluster.launcher import launch
from common.config import PoolConfig
from tests.cluster.conftest import run
from tests.cluster.test_disaggregated import GREEDY, SMALL_POOL, _assert_clean, _config, _generate_all
from tests.engine.test_moe_int4_weights import SPECS, dequantized_moe_reference, quantize_moe
from tests.engine.test_quantized_checkpoints import CONFIGS
from tests.factories import hf_greedy_generate, random_prompts
from tests.moe_factories import make_moe_checkpoint


@pytest.fixture(scope="module")
def int4_moe_cluster(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-moe")
    model_dir = make_moe_checkpoint(root / "model", SPECS["qwen3moe"])
    quantized = quantize_moe(model_dir, root / "quantized", CONFIGS["gptq-v1-w4-g32-asym-act"])
    reference = dequantized_moe_reference(model_dir, quantized, root / "reference")
    int4 = {**SMALL_POOL.__dict__, "quantization": "int4"}
    cluster = launch(
        _config(prefill=PoolConfig(**int4), decode=PoolConfig(**{**int4, "tp_size": 2, "expert_parallel": True})),
        str(quantized),
    )
    yield cluster, reference
    cluster.shutdown()


def test_p1d1_tp2_ep_int4_experts_equal_hf_on_the_dequantized_weights(int4_moe_cluster):
    cluster, reference = int4_moe_cluster
    prompts = random_prompts(4, 2, 40, 512, seed=71)
    expected = hf_greedy_generate(reference, prompts, GREEDY.max_tokens)
    assert run(_generate_all(cluster, prompts)) == expected
    assert run(_generate_all(cluster, prompts, prefix="again")) == expected  # prefix-cache hits hand off too
    _assert_clean(cluster)
