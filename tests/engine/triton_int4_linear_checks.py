"""Checks of the Triton int4 linear kernel, shared by the CPU (interpreted) and CUDA tests.

`python -m tests.engine.triton_int4_linear_checks` with `TRITON_INTERPRET=1` runs them on the CPU under
Triton's interpreter, in a fresh process (tests/engine/interpreted.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.layers import int4_matmul
from engine.layers.int4_matmul import dequantize_int4, pack_int4

# rows, in features, out features, group size: every group size, ragged rows and output channels, input
# rows of one group (the whole row) and of several, tiles past the row's end.
SHAPES = [
    (1, 256, 96, 128),
    (3, 96, 37, 32),
    (16, 192, 64, 64),
    (17, 64, 70, 64),
    (40, 160, 33, 32),
]


def _case(rows, k, n, group_size, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    scale = torch.rand(n, k // group_size, generator=gen) * 0.1 + 0.01
    zero = torch.randint(0, 16, (n, k // group_size), generator=gen).float()
    dequantized = dequantize_int4(packed, scale, zero).to(dtype)  # what the dequantize path widens to
    x = torch.randn(rows, k, generator=gen).to(dtype)
    exact = x.double() @ dequantized.double().T
    return x.to(device), packed.to(device), scale.to(device), zero.to(device), exact


def plans(rows, k, n):
    """The default plan, and forced ones: a split per tile (workspace path), the smallest tiles (32
    inputs: one 16-byte block) two per split."""
    from engine.kernels.triton_int8_linear import LaunchPlan, heuristic_plan

    default = heuristic_plan(rows, n, k)
    tiles_k = -(-k // default.block_k)
    return [default, default._replace(num_splits=tiles_k, tiles_per_split=1), LaunchPlan(16, 32, 32, -(-k // 64), 2, 4)]


def check_exact(device, dtype, tolerance):
    """Every plan against the fp64 product of the weights dequantized to `dtype`, relative to the
    output's size."""
    from engine.kernels.triton_int4_linear import int4_linear

    for index, (rows, k, n, group_size) in enumerate(SHAPES):
        x, packed, scale, zero, exact = _case(rows, k, n, group_size, dtype, device, seed=index)
        for plan in plans(rows, k, n):
            got = int4_linear(x, packed, scale, zero, plan)
            assert got.dtype == dtype and got.shape == (rows, n), (plan, got.dtype, got.shape)
            error = ((got.double().cpu() - exact).abs().max() / exact.abs().max()).item()
            assert error <= tolerance, (rows, k, n, group_size, plan, dtype, error)


def check_experts(device, dtype, tolerance):
    """int4 experts (engine/layers/fused_moe.py `Int4Experts`, act-order ones included) with every matmul
    on the kernel, against the fp64 top-k sum of the dequantized experts, relative to the output's size."""
    import torch.nn.functional as F

    from engine.layers.fused_moe import FusedMoE
    from engine.quantization.base import GroupQuantized

    experts, hidden, inter, tokens, top_k = 4, 64, 96, 6, 2
    gen = torch.Generator().manual_seed(11)
    layer = FusedMoE(experts, hidden, inter, dtype, quantization="int4")
    dense = {}
    for expert in range(experts):
        act_order = expert % 2 == 0  # gate and up share one order; down has its own
        orders = [torch.randperm(n, generator=gen) if act_order else torch.arange(n) for n in (hidden, inter)]
        for half, (out_features, in_features, order) in enumerate(
            [(inter, hidden, orders[0]), (inter, hidden, orders[0]), (hidden, inter, orders[1])]
        ):
            values = torch.randint(0, 16, (out_features, in_features), generator=gen)
            scales = torch.rand(in_features // 32, out_features, generator=gen) * 0.1 + 0.01
            zeros = torch.randint(0, 16, scales.shape, generator=gen).float()
            g_idx = torch.empty(in_features, dtype=torch.long)
            g_idx[order] = torch.arange(in_features) // 32
            form = GroupQuantized(f"e{expert}.{half}", values, scales, zeros, 32, 4, g_idx if act_order else None)
            weight = ((values - zeros[g_idx].t()) * scales[g_idx].t()).float()
            weight.group_quantized = form  # type: ignore[attr-defined]
            dense[(expert, half)] = weight.double()
            param = layer.w2_weight if half == 2 else layer.w13_weight
            param.weight_loader(param, weight, (expert, None if half == 2 else half))
    layer.to(device)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    expert_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    with triton_backend_forced():
        got = layer(x.to(device), expert_ids.to(device), weights.to(device)).double().cpu()
    exact = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for k in range(top_k):
            e, row = int(expert_ids[t, k]), x[t].double()
            h = F.silu(row @ dense[(e, 0)].t()) * (row @ dense[(e, 1)].t())
            exact[t] += weights[t, k].double() * (h @ dense[(e, 2)].t())
    error = ((got - exact).abs().max() / exact.abs().max()).item()
    assert error <= tolerance, ("experts", dtype, error)


@contextmanager
def triton_backend_forced():
    """`int4_matmul` dispatches every call to the Triton kernel (interpreted on the CPU)."""
    saved = int4_matmul.BACKENDS
    int4_matmul.BACKENDS = (int4_matmul.Backend("triton", lambda x: True, int4_matmul._triton),)
    try:
        yield
    finally:
        int4_matmul.BACKENDS = saved


if __name__ == "__main__":
    check_exact("cpu", torch.float32, 1e-6)
    check_exact("cpu", torch.float16, 2e-3)  # the interpreter has no bf16 (numpy): CUDA tests take it
    check_experts("cpu", torch.float32, 1e-5)
    print("interpreted int4 linear checks passed")
