"""GPTQ and AWQ checkpoints across the disaggregated cluster (one prefill worker, one decode instance of TP=2)
on real Ray actors: greedy fp32 tokens equal HF `generate` on the checkpoint's dequantized weights.

One module-scoped cluster per checkpoint, each answering several assertions:
- 4-bit, groups of 32, symmetric, no act-order, with the decode pool storing int4: each rank keeps
  its shard of the packed integers with their group scales and zero points (column-parallel layers by
  output rows, row-parallel ones by input columns in whole groups) while the prefill worker serves the
  dequantized weights;
- 4-bit, groups of 32, asymmetric, act-order (`desc_act` with a shuffled `g_idx`), served dequantized:
  every weight takes its group's scale and zero through `g_idx` before the ranks shard it;
- AWQ GEMM, 4-bit, groups of 64, with the prefill worker storing int4 and the decode ranks the
  dequantized weights (a rank's 32 inputs of a row-parallel layer would split a group of 64).
"""

from __future__ import annotations

import pytest

from cluster.launcher import launch
from common.config import PoolConfig
from engine.model_loader import load_model_config
from engine.quantization import checkpoint_format
from tests.cluster.conftest import run
from tests.cluster.test_disaggregated import GREEDY, SMALL_POOL, _assert_clean, _config, _generate_all
from tests.engine.test_quantized_checkpoints import CONFIGS, _quantize, dequantized_reference
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

SPEC = TinySpec(num_heads=4, num_kv_heads=2, seed=41)  # 64 / 2 and 128 / 2 inputs per rank: whole groups of 32
# checkpoint case → (weight quantization of the decode pool, of the prefill pool)
CASES = {
    "gptq-v1-w4-g32-sym": ("int4", "none"),
    "gptq-v1-w4-g32-asym-act": ("none", "none"),
    "awq-w4-g64": ("none", "int4"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def quantized_cluster(request, ray_session, checkpoint, tmp_path_factory):
    """(cluster, quantized checkpoint, HF reference checkpoint, quantization_config) for one case."""
    case = request.param
    config = CONFIGS[case]
    model_dir = checkpoint(SPEC)
    quantized = _quantize(model_dir, tmp_path_factory.mktemp("quantized") / case, config)
    reference = dequantized_reference(model_dir, quantized, config, tmp_path_factory.mktemp("reference") / case)
    decode_quantization, prefill_quantization = CASES[case]
    cluster = launch(
        _config(
            prefill=PoolConfig(**{**SMALL_POOL.__dict__, "quantization": prefill_quantization}),
            decode=PoolConfig(**{**SMALL_POOL.__dict__, "tp_size": 2, "quantization": decode_quantization}),
        ),
        str(quantized),
    )
    yield cluster, quantized, reference, config
    cluster.shutdown()


def test_p1d1_decode_tp2_on_a_quantized_checkpoint_equals_hf_on_its_dequantized_weights(quantized_cluster):
    cluster, _, reference, _ = quantized_cluster
    prompts = random_prompts(5, 2, 40, SPEC.vocab_size, seed=43)
    expected = hf_greedy_generate(reference, prompts, GREEDY.max_tokens)
    assert run(_generate_all(cluster, prompts)) == expected
    # Again, now from the prefill worker's prefix cache: the hits hand off the same blocks.
    assert run(_generate_all(cluster, prompts, prefix="again")) == expected
    _assert_clean(cluster)


def test_every_worker_names_the_checkpoints_quantization_in_its_identity(quantized_cluster):
    cluster, quantized, _, config = quantized_cluster
    identity = load_model_config(quantized).identity
    assert identity.endswith(checkpoint_format({"quantization_config": config}).label)
    assert all(w.info.model_identity.startswith(identity) for w in cluster.prefill)
