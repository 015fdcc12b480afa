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
    print("interpreted int4 linear checks passed")
