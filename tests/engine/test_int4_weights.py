"""Group-wise int4 weights (`quantization: int4`): the stored layout, the C kernel against a float64
reference, and the engine serving GPTQ / AWQ checkpoints' own integers and rounding unquantized ones at
load, token for token against HF `generate` on the dequantized weights (decode rows through the C
kernel, prefill chunks through the widened BLAS matmul)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.errors import UnsupportedModelError
from engine.layers.int4_matmul import BACKENDS, NATIVE_MAX_ROWS, dequantize_int4, int4_matmul, pack_int4, unpack_int4
from engine.layers.linear import RowParallelLinear
from engine.layers.quantization import Int4GroupWise
from engine.parallel import TensorParallelGroup
from engine.quantization import checkpoint_format
from engine.quantization.base import GroupQuantized
from engine.quantization.rtn import rtn_quantize
from engine.quantization.writer import write_quantized, write_rtn
from tests.engine.test_quantized_checkpoints import CONFIGS, SPEC, dequantized_reference
from tests.factories import hf_greedy_generate, random_prompts


def test_the_layout_puts_input_j_and_j_plus_16_of_a_block_in_one_byte():
    values = torch.tensor([[i % 16 for i in range(32)]])  # inputs j and j + 16 hold the same value j
    assert pack_int4(values).tolist() == [[j | (j << 4) for j in range(16)]]
    values = torch.randint(0, 16, (5, 96), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(values)).long(), values)


@pytest.mark.parametrize(("out_features", "in_features", "group_size"), [(40, 64, 32), (24, 256, 128), (8, 96, 96)])
@pytest.mark.parametrize("rows", [1, 3, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 5])
def test_the_kernel_and_the_widened_path_match_a_float64_reference(out_features, in_features, group_size, rows):
    gen = torch.Generator().manual_seed(rows)
    packed = pack_int4(torch.randint(0, 16, (out_features, in_features), generator=gen))
    scale = torch.rand(out_features, in_features // group_size, generator=gen) + 0.05
    zero = torch.randint(0, 16, scale.shape, generator=gen).float()
    x = torch.randn(rows, in_features, generator=gen)
    expected = x.double() @ dequantize_int4(packed, scale, zero).double().t()
    backend = next(b for b in BACKENDS if b.applies(x))
    assert backend.name == ("native" if rows <= NATIVE_MAX_ROWS else "dequantize")
    assert torch.allclose(int4_matmul(x, packed, scale, zero).double(), expected, rtol=1e-5, atol=1e-4)


def _greedy_matches(make_llm, model_dir, reference, seed: int) -> None:
    # Long prompts: prefill chunks exceed NATIVE_MAX_ROWS (the BLAS path); decode rows take the kernel.
    prompts = random_prompts(2, NATIVE_MAX_ROWS + 4, NATIVE_MAX_ROWS + 24, SPEC.vocab_size, seed=seed)
    expected = hf_greedy_generate(reference, prompts, 8)
    llm = make_llm(str(model_dir), dtype="float32", quantization="int4", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected


@pytest.mark.parametrize("case", ["gptq-v1-w4-g32-sym", "awq-w4-g64"])
def test_int4_weights_keep_a_checkpoints_own_integers(case, checkpoint, make_llm, tmp_path):
    config = CONFIGS[case]
    model_dir = checkpoint(SPEC)
    quantized = write_rtn(model_dir, tmp_path / "quantized", checkpoint_format({"quantization_config": config}))
    reference = dequantized_reference(model_dir, quantized, config, tmp_path / "reference")
    _greedy_matches(make_llm, quantized, reference, seed=51)


def test_int4_weights_round_an_unquantized_checkpoint_in_groups_at_load(checkpoint, make_llm, tmp_path):
    """The reference rounds every decoder projection as the loader does: asymmetric, groups of 128
    inputs where they divide the row, else 64 (the 64-wide projections)."""
    model_dir = checkpoint(SPEC)

    def rounded(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        group_size = 128 if weight.shape[1] % 128 == 0 else 64
        values, scales, zeros = rtn_quantize(weight, 4, group_size, sym=False)
        group = torch.arange(weight.shape[1]) // group_size
        return {"weight": (values - zeros[group].t()).float() * scales[group].t()}

    reference = write_quantized(
        model_dir, tmp_path / "reference", checkpoint_format({"quantization_config": {"quant_method": "fp8"}}), rounded
    )
    (reference / "config.json").write_text((model_dir / "config.json").read_text())  # a plain fp32 checkpoint
    _greedy_matches(make_llm, model_dir, reference, seed=52)


def test_act_order_groups_and_shards_that_split_a_group_fail_naming_the_layer():
    values = torch.randint(0, 16, (8, 64))
    scales, zeros = torch.ones(1, 8), torch.zeros(1, 8)
    shuffled = GroupQuantized("model.layers.3.mlp.down_proj", values, scales, zeros, 64, 4, contiguous=False)
    weight = torch.zeros(8, 64)
    weight.group_quantized = shuffled  # type: ignore[attr-defined]
    rank1 = TensorParallelGroup(rank=1, size=2, process_group=object())  # loading runs no collective
    layer = RowParallelLinear(64, 8, bias=False, dtype=torch.float32, tp=rank1, method=Int4GroupWise())
    with pytest.raises(
        UnsupportedModelError, match=r"model.layers.3.mlp.down_proj: int4 weights cannot hold act-order"
    ):
        layer.weight.weight_loader(layer.weight, weight)
    weight.group_quantized = shuffled._replace(contiguous=True)  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedModelError, match=r"shard of 32 input features would split its groups of 64"):
        layer.weight.weight_loader(layer.weight, weight)
    # Groups of 32: rank 1 holds the second group whole, exactly its slice of the full layer.
    scales, zeros = torch.rand(2, 8) + 0.1, torch.randint(0, 16, (2, 8)).float()
    weight.group_quantized = GroupQuantized("x", values, scales, zeros, 32, 4, True)  # type: ignore[attr-defined]
    layer.weight.weight_loader(layer.weight, weight)
    full = dequantize_int4(pack_int4(values), scales.t().contiguous(), zeros.t().contiguous())
    assert torch.equal(dequantize_int4(layer.weight, layer.weight_scale, layer.weight_zero), full[:, 32:])
