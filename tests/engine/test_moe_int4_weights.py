"""int4 expert weights (`quantization: int4`): a GPTQ or AWQ mixture-of-experts checkpoint keeps its
experts' own 4-bit integers, group scales and zero points, and greedy fp32 tokens of Mixtral,
Qwen2-MoE, Qwen3-MoE and DeepSeek-V2 equal HF `generate` on the checkpoint's dequantized weights
(prefill chunks through the widened BLAS matmul, decode rows through the C kernel). The experts hold
int4-sized bytes; act-order experts are sorted by group per expert; what stays refused fails naming
the layer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import SamplingParams
from engine.errors import UnsupportedModelError
from engine.layers.fused_moe import FusedMoE, Int4Experts
from engine.layers.int4_matmul import NATIVE_MAX_ROWS, dequantize_int4
from engine.layers.quantization import WeightQuantization
from engine.parallel import TensorParallelGroup
from engine.quantization import checkpoint_format
from engine.quantization.base import GroupQuantized
from engine.quantization.writer import WEIGHT_FILES, write_quantized, write_rtn
from splitserve.cli import main as cli_main
from tests.engine.test_quantized_checkpoints import CONFIGS, REFERENCES
from tests.factories import hf_greedy_generate, random_prompts
from tests.moe_factories import make_moe_checkpoint, moe_spec

MAX_TOKENS = 8
# Every quantized layer's inputs a multiple of its group: Mixtral's experts read 96 features, Qwen2-MoE's
# shared expert 64, Qwen3-MoE's experts 64 here (AWQ's groups are 64 or 128), DeepSeek-V2's experts 32.
SPECS = {
    "mixtral": moe_spec("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2moe": moe_spec("qwen2_moe", num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64),
    "qwen3moe": moe_spec("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "deepseekv2": moe_spec(
        "deepseek_v2",
        n_routed_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        first_k_dense_replace=1,
    ),
}
# `splitserve quantize` arguments (rtn writes GPTQ's layout) or, for the layouts it writes only with
# calibration, the writer's round-to-nearest on that format's grid.
CASES = {
    "mixtral-gptq-g32-sym": ("mixtral", ["--method", "rtn", "--bits", "4", "--group-size", "32"]),
    "qwen2moe-gptq-g32-asym": ("qwen2moe", ["--method", "rtn", "--bits", "4", "--group-size", "32", "--asym"]),
    "qwen3moe-awq-g64": ("qwen3moe", CONFIGS["awq-w4-g64"]),
    "deepseekv2-gptq-g32-asym-act": ("deepseekv2", CONFIGS["gptq-v1-w4-g32-asym-act"]),
}

SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}


def quantize_moe(model_dir: Path, out_dir: Path, how: list[str] | dict) -> Path:
    if isinstance(how, list):
        cli_main(["quantize", str(model_dir), str(out_dir), *how])
        return out_dir
    fmt = checkpoint_format({"quantization_config": how})
    if not how.get("desc_act"):
        return write_rtn(model_dir, out_dir, fmt)
    generator = torch.Generator().manual_seed(5)
    orders: dict[tuple[str, str], torch.Tensor] = {}

    def act_order(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """An act-order permutation per input, as GPTQ's would be: projections that read one input
        (q/k/v, an MLP's or expert's gate/up) share its Hessian, hence its order."""
        parent, _, projection = prefix.rpartition(".")
        key = (parent, SHARED_INPUT.get(projection, projection))
        if key not in orders:
            orders[key] = torch.randperm(weight.shape[1], generator=generator)
        return fmt.rtn_parts(weight, orders[key])

    return write_quantized(model_dir, out_dir, fmt, act_order)


def dequantized_moe_reference(model_dir: Path, quantized_dir: Path, out_dir: Path) -> Path:
    """The source checkpoint with every quantized layer (experts included) replaced by its weight as the
    test's own reading of the format computes it: HF's per-expert layout, loaded by HF's own classes."""
    fmt = checkpoint_format({"quantization_config": _quantization_config(quantized_dir)})
    assert fmt is not None
    with safe_open(quantized_dir / "model.safetensors", framework="pt") as handle:
        stored = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    prefixes = {name.removesuffix(".qweight") for name in stored if name.endswith(".qweight")}
    tensors = {name: t for name, t in stored.items() if name.rpartition(".")[2] not in fmt.layer_parts}
    for prefix in prefixes:
        parts = {part: stored[f"{prefix}.{part}"] for part in fmt.layer_parts if f"{prefix}.{part}" in stored}
        tensors[f"{prefix}.weight"] = REFERENCES[fmt.method](parts, fmt.config())
    out_dir.mkdir(parents=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in WEIGHT_FILES:
            shutil.copy2(path, out_dir / path.name)
    return out_dir


def _quantization_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())["quantization_config"]


def _expert_layers(llm) -> list[FusedMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_int4_experts_equal_hf_on_the_dequantized_checkpoint(case, make_llm, tmp_path):
    family, how = CASES[case]
    model_dir = make_moe_checkpoint(tmp_path / "model", SPECS[family])
    quantized = quantize_moe(model_dir, tmp_path / "quantized", how)
    reference = dequantized_moe_reference(model_dir, quantized, tmp_path / "reference")
    prompts = random_prompts(2, NATIVE_MAX_ROWS + 10, NATIVE_MAX_ROWS + 30, 512, seed=7) + random_prompts(
        2, 3, 20, 512, seed=8
    )
    llm = make_llm(str(quantized), dtype="float32", num_kv_blocks=128, quantization="int4")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy_generate(reference, prompts, MAX_TOKENS)
    experts = _expert_layers(llm)
    assert experts and all(isinstance(layer.method, Int4Experts) for layer in experts)
    for layer in experts:
        held = sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))
        values = layer.w13_weight.numel() * 2 + layer.w2_weight.numel() * 2
        assert layer.w13_weight.dtype == layer.w2_weight.dtype == torch.uint8
        groups = layer.w13_weight_scale.numel() + layer.w2_weight_scale.numel()
        orders = [layer.w13_weight_input_order, layer.w2_weight_input_order]
        # Exactly 4 bits a weight, an fp32 scale and zero per group (of 32 or 64 inputs) and an int64
        # index per act-order input of each expert: under a quarter of the fp32 experts' 4 bytes a weight.
        assert held == values // 2 + 8 * groups + 8 * sum(o.numel() for o in orders if o is not None)
        assert held < values
    act_order = [layer.w13_weight_input_order is not None for layer in experts]
    assert all(act_order) == ("act" in case)


def _act_order_expert(name: str, out_features: int, in_features: int, group_size: int, seed: int) -> GroupQuantized:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (out_features, in_features), generator=gen)
    groups = in_features // group_size
    scales = torch.rand(groups, out_features, generator=gen) + 0.05
    zeros = torch.randint(0, 17, (groups, out_features), generator=gen).float()
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[torch.randperm(in_features, generator=gen)] = (torch.arange(in_features) // group_size).to(torch.int32)
    return GroupQuantized(name, values, scales, zeros, group_size, 4, g_idx)


def _dequantized(form: GroupQuantized) -> torch.Tensor:
    group = torch.arange(form.values.shape[1]) // form.group_size if form.g_idx is None else form.g_idx.long()
    return (form.values - form.zeros[group].t()) * form.scales[group].t()


def _weight(form: GroupQuantized) -> torch.Tensor:
    weight = _dequantized(form).float()
    weight.group_quantized = form  # type: ignore[attr-defined]
    return weight


def _load_act_order_experts(layer: FusedMoE, experts: int, hidden: int, inter: int) -> dict:
    forms = {}
    for expert in range(experts):
        gate = _act_order_expert(f"e{expert}.gate", inter, hidden, 32, seed=expert)
        up = gate._replace(name=f"e{expert}.up", values=torch.randint(0, 16, gate.values.shape))  # one order
        down = _act_order_expert(f"e{expert}.down", hidden, inter, 32, seed=100 + expert)
        forms[expert] = (gate, up, down)
        layer.w13_weight.weight_loader(layer.w13_weight, _weight(gate), (expert, 0))
        layer.w13_weight.weight_loader(layer.w13_weight, _weight(up), (expert, 1))
        layer.w2_weight.weight_loader(layer.w2_weight, _weight(down), (expert, None))
    return forms


@pytest.mark.parametrize("rank", [0, 1])
def test_act_order_experts_are_sorted_by_group_per_expert_and_compute_the_dequantized_experts(rank):
    """Expert parallel at TP=2: each rank holds whole experts, each with its own input orders."""
    experts, hidden, inter = 4, 64, 64
    group = TensorParallelGroup(rank=rank, size=2, process_group=object())  # loading runs no collective
    layer = FusedMoE(experts, hidden, inter, torch.float32, group, True, WeightQuantization("int4"))
    forms = _load_act_order_experts(layer, experts, hidden, inter)
    assert layer.w13_weight.shape == (2, 2 * inter, hidden // 2) and layer.w2_weight_input_order.shape == (2, inter)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
    for local in range(2):
        gate, up, down = forms[rank * 2 + local]
        w13 = torch.cat([_dequantized(gate), _dequantized(up)]).double()
        got = layer.method.apply(layer, "w13_weight", local, x).double()
        torch.testing.assert_close(got, x.double() @ w13.t(), rtol=1e-5, atol=1e-4)
        h = torch.randn(5, inter, generator=torch.Generator().manual_seed(2))
        got = layer.method.apply(layer, "w2_weight", local, h).double()
        torch.testing.assert_close(got, h.double() @ _dequantized(down).double().t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group_size", [32, 128])
def test_tp_sharded_act_order_experts_hold_the_groups_their_inputs_touch(group_size):
    """TP-sharded experts: each rank's down projections hold parts of every act-order group, as padded
    runs of 32 inputs; the ranks' partial sums add up to the dequantized experts' products."""
    experts, hidden, inter = 4, 64, 256
    downs = [_act_order_expert(f"e{e}.down_proj", hidden, inter, group_size, seed=20 + e) for e in range(experts)]
    h = torch.randn(5, inter, generator=torch.Generator().manual_seed(2))
    totals = torch.zeros(experts, 5, hidden, dtype=torch.float64)
    for rank in range(2):
        group = TensorParallelGroup(rank=rank, size=2, process_group=object())
        layer = FusedMoE(experts, hidden, inter, torch.float32, group, False, WeightQuantization("int4"))
        for expert, down in enumerate(downs):
            layer.w2_weight.weight_loader(layer.w2_weight, _weight(down), (expert, None))
        orders = layer.w2_weight_input_order
        assert orders.shape == (experts, layer.w2_weight.shape[2] * 2) and layer.w2_weight.dtype == torch.uint8
        for expert in range(experts):
            read = orders[expert][orders[expert] < inter // 2]  # the rest read the zero feature
            assert torch.equal(read.sort().values, torch.arange(inter // 2))
            rows = h[:, rank * inter // 2 : (rank + 1) * inter // 2]
            totals[expert] += layer.method.apply(layer, "w2_weight", expert, rows).double()
    for expert, down in enumerate(downs):
        torch.testing.assert_close(totals[expert], h.double() @ _dequantized(down).double().t(), rtol=1e-5, atol=1e-4)


def test_what_int4_experts_refuse_fails_naming_the_layer():
    rank1 = TensorParallelGroup(rank=1, size=2, process_group=object())
    sharded = FusedMoE(4, 64, 64, torch.float32, rank1, expert_parallel=False, quantization="int4")
    plain = _act_order_expert("model.layers.1.mlp.experts.1.down_proj", 64, 64, 32, seed=3)._replace(g_idx=None)
    sharded.w2_weight.weight_loader(sharded.w2_weight, _weight(plain), (1, None))
    down = _act_order_expert("model.layers.1.mlp.experts.2.down_proj", 64, 64, 32, seed=3)
    with pytest.raises(UnsupportedModelError, match=r"experts.2.down_proj: act-order experts .* next to experts in"):
        sharded.w2_weight.weight_loader(sharded.w2_weight, _weight(down), (2, None))
    whole = FusedMoE(4, 64, 64, torch.float32, quantization="int4")
    gate = _act_order_expert("model.layers.1.mlp.experts.0.gate_proj", 64, 64, 32, seed=4)
    whole.w13_weight.weight_loader(whole.w13_weight, _weight(gate), (0, 0))
    up = _act_order_expert("model.layers.1.mlp.experts.0.up_proj", 64, 64, 32, seed=5)
    with pytest.raises(UnsupportedModelError, match=r"experts.0.up_proj: its inputs are grouped in another order"):
        whole.w13_weight.weight_loader(whole.w13_weight, _weight(up), (0, 1))
    coarse = _act_order_expert("model.layers.1.mlp.experts.1.down_proj", 64, 64, 64, seed=6)._replace(g_idx=None)
    whole.w2_weight.weight_loader(whole.w2_weight, _weight(down._replace(g_idx=None)), (0, None))
    with pytest.raises(UnsupportedModelError, match=r"experts.1.down_proj: groups of 64 inputs, unlike the other"):
        whole.w2_weight.weight_loader(whole.w2_weight, _weight(coarse), (1, None))
    with pytest.raises(UnsupportedModelError, match=r"multiple of 32 input features, got 48 for the experts' w2"):
        FusedMoE(4, 64, 48, torch.float32, quantization="int4")


def test_tp_sharded_int4_experts_hold_their_slice_of_the_single_rank_experts():
    experts, hidden, inter = 2, 64, 64
    gen = torch.Generator().manual_seed(3)
    checkpoint = {(e, h): torch.randn(inter, hidden, generator=gen) for e in range(experts) for h in (0, 1)}
    checkpoint |= {(e, None): torch.randn(hidden, inter, generator=gen) for e in range(experts)}

    def load(layer: FusedMoE) -> FusedMoE:
        for (expert, half), tensor in checkpoint.items():
            param = layer.w2_weight if half is None else layer.w13_weight
            param.weight_loader(param, tensor, (expert, half))
        return layer

    single = load(FusedMoE(experts, hidden, inter, torch.float32, quantization=WeightQuantization("int4", 32)))
    full_down = dequantize_int4(single.w2_weight[1], single.w2_weight_scale[1], single.w2_weight_zero[1])
    torch.testing.assert_close(full_down, checkpoint[(1, None)], atol=0.5, rtol=0)  # rounded at load, 4 bits
    for rank in range(2):
        group = TensorParallelGroup(rank=rank, size=2, process_group=object())
        layer = load(FusedMoE(experts, hidden, inter, torch.float32, group, False, WeightQuantization("int4", 32)))
        mine = dequantize_int4(layer.w2_weight[1], layer.w2_weight_scale[1], layer.w2_weight_zero[1])
        assert torch.equal(mine, full_down[:, rank * 32 : (rank + 1) * 32])
