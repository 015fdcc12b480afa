"""Group-wise int8 expert weights (`quantization: int8` with `quantization_group_size`): greedy fp32
tokens of Mixtral, Qwen2-MoE and DeepSeek-V2 equal HF on the dequantized checkpoint; a rank's shard of
the experts is exactly its slice of the single-rank int8 weights and scales (expert parallel and
TP-sharded experts); a group size that does not divide an expert's inputs fails naming the key."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.errors import UnsupportedModelError
from engine.layers.fused_moe import FusedMoE, Int8GroupExperts
from engine.layers.int8_group_matmul import NATIVE_MAX_ROWS, quantize_groupwise
from engine.layers.quantization import WeightQuantization
from engine.parallel import TensorParallelGroup
from tests.factories import hf_greedy_generate, random_prompts
from tests.moe_factories import dequantized_moe_checkpoint, make_moe_checkpoint, moe_spec

GROUP_SIZE = 32
MAX_TOKENS = 10
# Every linear layer's and expert's inputs a multiple of 32: Qwen2-MoE's shared expert 64 features,
# DeepSeek-V2's latent 32 (its kv_b_proj reads it), Mixtral's experts 96.
SPECS = {
    "mixtral-e4-top2": moe_spec("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2moe-shared": moe_spec("qwen2_moe", num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64),
    "deepseekv2-mla-dense1": moe_spec(
        "deepseek_v2",
        n_routed_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        first_k_dense_replace=1,
    ),
}
GROUP_INT8 = WeightQuantization("int8", GROUP_SIZE)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_group_wise_int8_experts_equal_hf_on_the_dequantized_checkpoint(name, make_llm, tmp_path):
    """Prefill chunks past NATIVE_MAX_ROWS rows widen the weights for BLAS; decode rows run the C kernel."""
    model_dir = make_moe_checkpoint(tmp_path / "model", SPECS[name])
    reference = dequantized_moe_checkpoint(model_dir, tmp_path / "dequantized", group_size=GROUP_SIZE)
    prompts = random_prompts(2, NATIVE_MAX_ROWS + 10, NATIVE_MAX_ROWS + 30, 512, seed=7) + random_prompts(
        2, 3, 20, 512, seed=8
    )
    llm = make_llm(model_dir, num_kv_blocks=128, quantization="int8", quantization_group_size=GROUP_SIZE)
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert isinstance(experts.method, Int8GroupExperts)
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.int8
    assert experts.w2_weight_scale.shape[2] == experts.w2_weight.shape[2] // GROUP_SIZE
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy_generate(reference, prompts, MAX_TOKENS)


def _load(layer: FusedMoE, checkpoint: dict[tuple[int, int | None], torch.Tensor]) -> FusedMoE:
    for (expert, half), tensor in checkpoint.items():
        param = layer.w2_weight if half is None else layer.w13_weight
        param.weight_loader(param, tensor, (expert, half))
    return layer


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "tp-sharded-experts"])
def test_each_rank_holds_its_slice_of_the_single_rank_weights_and_scales(expert_parallel):
    """Scales are taken over the full checkpoint row, so TP=2 differs from TP=1 only in summation order."""
    experts, hidden, inter = 4, 64, 64
    gen = torch.Generator().manual_seed(3)
    checkpoint = {(e, h): torch.randn(inter, hidden, generator=gen) for e in range(experts) for h in (0, 1)}
    checkpoint |= {(e, None): torch.randn(hidden, inter, generator=gen) for e in range(experts)}
    single = _load(FusedMoE(experts, hidden, inter, torch.float32, quantization=GROUP_INT8), checkpoint)
    down_values, down_scale = quantize_groupwise(checkpoint[(1, None)], GROUP_SIZE)
    assert torch.equal(single.w2_weight[1], down_values) and torch.equal(single.w2_weight_scale[1], down_scale)
    for rank in range(2):
        group = TensorParallelGroup(rank=rank, size=2, process_group=object())  # loading runs no collective
        layer = FusedMoE(experts, hidden, inter, torch.float32, group, expert_parallel, GROUP_INT8)
        _load(layer, checkpoint)
        for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
            full, mine = getattr(single, name), getattr(layer, name)
            if expert_parallel:
                want = full[rank * experts // 2 : (rank + 1) * experts // 2]
            elif name.startswith("w13"):  # gate rows then up rows, each half this rank's
                half = inter // 2
                want = torch.cat(
                    [full[:, rank * half : (rank + 1) * half], full[:, inter + rank * half :][:, :half]], 1
                )
            else:  # down: this rank's intermediate features, and their groups' scales
                columns = mine.shape[2]
                want = full[:, :, rank * columns : (rank + 1) * columns]
            assert torch.equal(mine, want), (rank, name)


def test_a_group_that_does_not_divide_an_experts_inputs_fails_naming_the_key(make_llm, tmp_path):
    with pytest.raises(UnsupportedModelError, match="quantization_group_size: 64 does not divide the 96 input"):
        FusedMoE(4, 64, 96, torch.float32, quantization=WeightQuantization("int8", 64))
    rank1 = TensorParallelGroup(rank=1, size=2, process_group=object())
    with pytest.raises(UnsupportedModelError, match=r"quantization_group_size: 32 does not divide the 16 input .*w2_"):
        FusedMoE(4, 64, 32, torch.float32, rank1, expert_parallel=False, quantization=GROUP_INT8)
    assert isinstance(FusedMoE(4, 64, 32, torch.float32, rank1, quantization=GROUP_INT8).method, Int8GroupExperts)
    model_dir = make_moe_checkpoint(tmp_path, SPECS["mixtral-e4-top2"])  # experts' down reads 96 features
    with pytest.raises(UnsupportedModelError, match="quantization_group_size: 64 does not divide the 96 input"):
        make_llm(model_dir, quantization="int8", quantization_group_size=64)
