"""Group-wise int8 weights (`quantization: int8` with `quantization_group_size`): the kernel and the
widened path against a float64 reference, each weight within half its group's step, each layer
within the stated bound, greedy tokens equal to HF on the dequantized checkpoint, and errors that
name the key."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.errors import UnsupportedModelError
from engine.kernels import kernel
from engine.layers.int8_group_matmul import (
    BACKENDS,
    NATIVE_MAX_ROWS,
    dequantize_groupwise,
    int8_group_matmul,
    quantize_groupwise,
)
from engine.layers.linear import RowParallelLinear
from engine.layers.quantization import Int8GroupWise, quantize_per_channel
from engine.parallel import TensorParallelGroup
from tests.factories import TinySpec, dequantized_checkpoint, hf_greedy_generate, random_prompts

# (rows, input features, output features, group size): ragged rows and output channels (not a multiple
# of the kernel's 4-row passes), one group per row, many groups.
SHAPES = [(1, 768, 130, 128), (3, 64, 5, 32), (4, 96, 7, 32), (17, 256, 33, 64), (16, 512, 40, 512), (40, 128, 9, 32)]


def test_a_hand_computed_group_gets_its_own_scale():
    weight = torch.tensor([[127.0, -63.5, 1.0, 0.0] * 8 + [0.5, -0.25, 0.0, 0.0] * 8])  # two groups of 32
    values, scale = quantize_groupwise(weight, 32)
    assert torch.equal(scale, torch.tensor([[127.0, 0.5]]) / 127)
    assert values[0, :4].tolist() == [127, -64, 1, 0]  # -63.5 rounds half to even
    assert values[0, 32:36].tolist() == [127, -64, 0, 0]
    _, per_channel = quantize_per_channel(weight)
    assert per_channel.item() == 1.0  # one scale for the row would round the second group to 0, 0, ...


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_each_weight_is_within_half_its_groups_step(group_size):
    gen = torch.Generator().manual_seed(group_size)
    weight = torch.randn(48, 256, generator=gen) * torch.rand(1, 256, generator=gen) * 4  # uneven columns
    values, scale = quantize_groupwise(weight, group_size)
    assert values.dtype == torch.int8 and scale.shape == (48, 256 // group_size)
    step = scale.repeat_interleave(group_size, dim=1)
    assert torch.all((weight - dequantize_groupwise(values, scale)).abs() <= step / 2 * (1 + 1e-6))
    # Finer groups never have a coarser step than the row's per-channel scale.
    _, per_channel = quantize_per_channel(weight)
    assert torch.all(scale <= per_channel[:, None] * (1 + 1e-6))


@pytest.mark.parametrize("rows, k, n, group_size", SHAPES)
@pytest.mark.parametrize("name", ["native", "dequantize"])
def test_both_backends_equal_the_exact_product(name, rows, k, n, group_size):
    assert kernel("int8_group_linear") is not None, "the C kernel must build on this machine (cc is required)"
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    values, scale = quantize_groupwise(torch.randn(n, k, generator=gen), group_size)
    x = torch.randn(rows, k, generator=gen)
    exact = x.double() @ dequantize_groupwise(values, scale).double().T
    got = next(b for b in BACKENDS if b.name == name).run(x, values, scale)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)


def test_dispatch_by_rows_keeps_leading_dimensions():
    values, scale = quantize_groupwise(torch.randn(8, 64), 32)
    assert next(b for b in BACKENDS if b.applies(torch.zeros(NATIVE_MAX_ROWS, 64))).name == "native"
    assert next(b for b in BACKENDS if b.applies(torch.zeros(NATIVE_MAX_ROWS + 1, 64))).name == "dequantize"
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(
        int8_group_matmul(x, values, scale), int8_group_matmul(x.view(6, 64), values, scale).view(2, 3, 8)
    )


def test_each_layer_is_within_the_stated_error_and_below_per_channel(checkpoint, make_llm):
    """Per output channel the error of a layer is at most sum over groups of (sum of |x| in the group) x
    the group's scale / 2 (each weight is off by at most half its group's step); over the model,
    groups of 32 have a smaller error than one scale per row."""
    model_dir = checkpoint(TinySpec(arch="qwen2", hidden_size=64, num_heads=4, head_dim=16))
    fp32 = make_llm(model_dir).engine.runner.model
    grouped = make_llm(model_dir, quantization="int8", quantization_group_size=32, quantize_lm_head=True)
    per_channel = make_llm(model_dir, quantization="int8", quantize_lm_head=True).engine.runner.model
    model = grouped.engine.runner.model
    layers = [name for name, module in model.named_modules() if hasattr(module, "weight_scale")]
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    gen = torch.Generator().manual_seed(0)
    grouped_error = channel_error = 0.0
    for name in layers:
        ours, theirs = model.get_submodule(name), fp32.get_submodule(name)
        assert ours.weight_scale.shape == (theirs.weight.shape[0], theirs.weight.shape[1] // 32)
        x = torch.randn(5, theirs.weight.shape[1], generator=gen)
        got, want = ours(x), theirs(x)
        group_abs = x.abs().view(5, -1, 32).sum(-1)  # [rows, groups]
        bound = group_abs @ ours.weight_scale.T / 2
        assert torch.all((got - want).abs() <= bound + 1e-5), name
        grouped_error += (got - want).norm().item()
        channel_error += (per_channel.get_submodule(name)(x) - want).norm().item()
    assert grouped_error < channel_error


def test_engine_with_group_wise_int8_equals_hf_on_the_dequantized_checkpoint(checkpoint, make_llm, tmp_path):
    """Through the C kernel (decode rows) and the widened BLAS matmul (prefill chunks past
    NATIVE_MAX_ROWS rows), the LM head quantized too."""
    model_dir = checkpoint(TinySpec(arch="llama", seed=21))
    reference = dequantized_checkpoint(model_dir, tmp_path / "dequantized", quantize_lm_head=True, group_size=32)
    prompts = random_prompts(3, NATIVE_MAX_ROWS + 10, NATIVE_MAX_ROWS + 40, 512, seed=22) + random_prompts(
        3, 2, 20, 512, seed=23
    )
    expected = hf_greedy_generate(reference, prompts, 12)
    llm = make_llm(
        model_dir, quantization="int8", quantization_group_size=32, quantize_lm_head=True, max_num_batched_tokens=256
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected


@pytest.mark.parametrize(
    "options, message",
    [
        ({"quantization_group_size": 64}, "quantization_group_size: needs a weight quantization"),
        ({"quantization": "int8", "quantization_group_size": 48}, "quantization_group_size: must be None or a pos"),
        ({"quantization": "int8", "quantization_group_size": 0}, "quantization_group_size: must be None or a pos"),
    ],
)
def test_bad_group_sizes_fail_naming_the_key(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model_dir="m", **options)


def test_a_group_that_does_not_divide_a_layer_or_its_shard_fails_naming_the_key(checkpoint, make_llm):
    with pytest.raises(UnsupportedModelError, match="quantization_group_size: 128 does not divide a layer's 64"):
        make_llm(checkpoint(TinySpec()), quantization="int8", quantization_group_size=128)
    rank1 = TensorParallelGroup(rank=1, size=2, process_group=object())  # loading runs no collective
    with pytest.raises(UnsupportedModelError, match="quantization_group_size: 64 does not divide a layer's 32"):
        RowParallelLinear(64, 8, bias=False, dtype=torch.float32, tp=rank1, method=Int8GroupWise(64))
    layer = RowParallelLinear(64, 8, bias=False, dtype=torch.float32, tp=rank1, method=Int8GroupWise(32))
    weight = torch.randn(8, 64)
    layer.weight.weight_loader(layer.weight, weight)
    values, scale = quantize_groupwise(weight, 32)
    assert torch.equal(layer.weight, values[:, 32:]) and torch.equal(layer.weight_scale, scale[:, 1:])


def test_int4_rounds_an_unquantized_checkpoint_in_the_configured_groups(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    model = make_llm(model_dir, quantization="int4", quantization_group_size=32).engine.runner.model
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert down.weight_scale.shape == (64, 128 // 32)
    default = make_llm(model_dir, quantization="int4").engine.runner.model
    assert default.get_submodule("model.layers.0.mlp.down_proj").weight_scale.shape == (64, 1)  # 128 inputs
