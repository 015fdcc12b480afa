"""Group-wise int4 weights (`quantization: int4`): the stored layout, the C kernel against a float64
reference, and the engine serving GPTQ / AWQ checkpoints' own integers and rounding unquantized ones at
load, token for token against HF `generate` on the dequantized weights (decode rows through the C
kernel, prefill chunks through the widened BLAS matmul)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import SamplingParams
from engine.errors import UnsupportedModelError
from engine.layers.int4_matmul import BACKENDS, NATIVE_MAX_ROWS, dequantize_int4, int4_matmul, pack_int4, unpack_int4
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.layers.quantization import Int4GroupWise
from engine.parallel import TensorParallelGroup
from engine.quantization import checkpoint_format
from engine.quantization.base import GroupQuantized
from engine.quantization.rtn import rtn_quantize
from engine.quantization.writer import write_quantized, write_rtn
from splitserve.cli import main as cli_main
from tests.engine.test_quantize_command import CALIBRATION
from tests.engine.test_quantize_command import RUNS as QUANTIZE_RUNS
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


def _act_order_layer(name: str, out_features: int, in_features: int, group_size: int, seed: int) -> GroupQuantized:
    """A layer whose groups were formed in a random input order, as GPTQ's act-order forms them."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (out_features, in_features), generator=gen)
    groups = in_features // group_size
    scales, zeros = torch.rand(groups, out_features, generator=gen) + 0.05, torch.randint(0, 16, (groups, out_features))
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[torch.randperm(in_features, generator=gen)] = (torch.arange(in_features) // group_size).to(torch.int32)
    return GroupQuantized(name, values, scales, zeros.float(), group_size, 4, g_idx)


def _dequantized(form: GroupQuantized) -> torch.Tensor:
    group = torch.arange(form.values.shape[1]) // form.group_size if form.g_idx is None else form.g_idx.long()
    return (form.values - form.zeros[group].t()) * form.scales[group].t()


def _loaded_weight(form: GroupQuantized) -> torch.Tensor:
    weight = torch.zeros(form.values.shape, dtype=torch.float32)
    weight.group_quantized = form  # type: ignore[attr-defined]
    return weight


@pytest.mark.parametrize("rows", [1, NATIVE_MAX_ROWS + 5])
def test_an_act_order_layer_is_stored_in_int4_with_its_inputs_sorted_by_group(rows):
    form = _act_order_layer("model.layers.0.mlp.down_proj", 24, 128, 32, seed=rows)
    layer = RowParallelLinear(128, 24, bias=False, dtype=torch.float32, method=Int4GroupWise())
    layer.weight.weight_loader(layer.weight, _loaded_weight(form))
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (24, 64)  # 4 bits a weight
    order = layer.input_order
    assert order is not None and not torch.equal(order, torch.arange(128))
    assert torch.equal(form.g_idx.long()[order], torch.arange(128) // 32)  # groups are runs of inputs now
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(9))
    expected = x.double() @ _dequantized(form).double().t()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, NATIVE_MAX_ROWS + 5])
@pytest.mark.parametrize(("group_size", "tp_size"), [(32, 2), (128, 2), (128, 4)])
def test_each_row_parallel_rank_of_an_act_order_layer_holds_the_groups_its_inputs_touch(rows, group_size, tp_size):
    """A rank's inputs hold parts of groups: each group it touches is stored whole or as runs of 32
    (whichever is smaller), padded with reads of a zero feature; the ranks' partial sums add up to the
    whole layer's product."""
    out_features, in_features = 24, 1024
    form = _act_order_layer("model.layers.0.mlp.down_proj", out_features, in_features, group_size, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(9))
    total = torch.zeros(rows, out_features, dtype=torch.float64)
    local = in_features // tp_size
    for rank in range(tp_size):
        group = TensorParallelGroup(rank=rank, size=tp_size, process_group=object())  # loading runs no collective
        layer = RowParallelLinear(in_features, 24, False, torch.float32, tp=group, method=Int4GroupWise())
        layer.weight.weight_loader(layer.weight, _loaded_weight(form))
        read = layer.input_order[layer.input_order < local]  # the rest read the zero feature (index `local`)
        assert layer.input_padded and torch.equal(read.sort().values, torch.arange(local))  # each input once
        stored = layer.weight.numel() + 8 * layer.weight_scale.numel()
        columns = torch.arange(rank * local, (rank + 1) * local)
        candidates = [form.shard_in_group_order(columns, run)[0] for run in (group_size, 32)]
        assert stored == min(c.values.numel() // 2 + 8 * c.scales.numel() for c in candidates)
        total += layer.method.apply(layer, x[:, rank * local : (rank + 1) * local]).double()
        # Random act-order touches every group from every rank: whole groups cost the unsharded layer;
        # runs of 32 about 1 / TP of it plus the padding of each group's last run and more scales.
        unsharded = out_features * in_features // 2 + 8 * out_features * in_features // group_size
        assert stored <= {(32, 2): 1.0, (128, 2): 0.9, (128, 4): 0.6}[(group_size, tp_size)] * unsharded
    torch.testing.assert_close(total, x.double() @ _dequantized(form).double().t(), rtol=1e-5, atol=1e-4)


def test_fused_parts_in_other_act_orders_fail_naming_the_layer():
    form = _act_order_layer("model.layers.3.mlp.down_proj", 8, 64, 32, seed=1)
    fused = MergedColumnParallelLinear(64, [8, 8], bias=False, dtype=torch.float32, method=Int4GroupWise())
    fused.weight.weight_loader(fused.weight, _loaded_weight(form._replace(name="gate_proj")), 0)
    other = _act_order_layer("model.layers.3.mlp.up_proj", 8, 64, 32, seed=2)
    with pytest.raises(UnsupportedModelError, match=r"model.layers.3.mlp.up_proj: its inputs are grouped in another"):
        fused.weight.weight_loader(fused.weight, _loaded_weight(other), 1)
    uneven = form._replace(g_idx=torch.zeros(64, dtype=torch.int32))  # one group of 64 where 32 were declared
    with pytest.raises(UnsupportedModelError, match="does not give every group 32 inputs"):
        uneven.in_group_order()


def test_shards_that_split_a_group_fail_naming_the_layer():
    values = torch.randint(0, 16, (8, 64))
    scales, zeros = torch.ones(1, 8), torch.zeros(1, 8)
    weight = _loaded_weight(GroupQuantized("model.layers.3.mlp.down_proj", values, scales, zeros, 64, 4, None))
    rank1 = TensorParallelGroup(rank=1, size=2, process_group=object())  # loading runs no collective
    layer = RowParallelLinear(64, 8, bias=False, dtype=torch.float32, tp=rank1, method=Int4GroupWise())
    with pytest.raises(UnsupportedModelError, match=r"shard of 32 input features would split its groups of 64"):
        layer.weight.weight_loader(layer.weight, weight)
    # Groups of 32: rank 1 holds the second group whole, exactly its slice of the full layer.
    scales, zeros = torch.rand(2, 8) + 0.1, torch.randint(0, 16, (2, 8)).float()
    weight.group_quantized = GroupQuantized("x", values, scales, zeros, 32, 4, None)  # type: ignore[attr-defined]
    layer.weight.weight_loader(layer.weight, weight)
    full = dequantize_int4(pack_int4(values), scales.t().contiguous(), zeros.t().contiguous())
    assert torch.equal(dequantize_int4(layer.weight, layer.weight_scale, layer.weight_zero), full[:, 32:])


def test_an_act_order_gptq_checkpoint_is_served_in_int4_like_hf_on_its_dequantized_weights(
    checkpoint, make_llm, tmp_path
):
    """`splitserve quantize --act-order` (q/k/v and gate/up share their input, hence one order each)."""
    model_dir = checkpoint(SPEC)
    out = tmp_path / "quantized"
    cli_main(["quantize", str(model_dir), str(out), *QUANTIZE_RUNS["gptq-w4-g32-act"], *CALIBRATION])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["desc_act"] is True
    reference = dequantized_reference(model_dir, out, config, tmp_path / "reference")
    prompts = random_prompts(2, NATIVE_MAX_ROWS + 4, NATIVE_MAX_ROWS + 24, SPEC.vocab_size, seed=53)
    expected = hf_greedy_generate(reference, prompts, 8)
    llm = make_llm(str(out), dtype="float32", quantization="int4", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    # Every projection holds 4-bit weights; the act-order ones an input order beside them.
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(getattr(m, "method", None), Int4GroupWise)]
    assert len(layers) == 4 * SPEC.num_layers  # qkv, o, gate_up, down
    assert sum(layer.input_order is not None for layer in layers) > 0
    weights = sum(layer.weight.numel() * 2 for layer in layers)
    stored_bytes = sum(
        t.numel() * t.element_size() for layer in layers for t in (*layer.parameters(), *layer.buffers())
    )
    # 4 bits a weight, an fp32 scale and zero per group of 32, an int64 index per act-order input
    assert stored_bytes < weights * (0.5 + 8 / 32 + 8 / 64)
