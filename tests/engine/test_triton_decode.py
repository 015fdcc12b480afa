"""The Triton paged decode kernel against an fp64 reference and the PyTorch quantized path
(tests/engine/triton_decode_checks.py).

On the CPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`: numpy, the same kernel code) in a
subprocess; on a GPU the compiled kernel runs (marked `cuda`). Shapes cover GQA / MQA / MHA, a
head_dim that is not a power of two, block sizes that do not divide a tile, one-token contexts,
several splits per sequence and several tiles per split.
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels.triton_decode import TARGET_PROGRAMS, TILE_TOKENS, SplitPlan, split_plan
from tests.engine.interpreted import run_interpreted
from tests.engine.triton_decode_checks import check_exact, check_fused, check_quantized


def test_split_plan_fills_the_gpu_and_covers_the_table():
    plan = split_plan(batch=64, num_kv_heads=8, table_width=128, block_size=16)
    assert plan.num_splits * plan.tiles_per_split * TILE_TOKENS >= 128 * 16
    assert 64 * 8 * plan.num_splits >= TARGET_PROGRAMS
    assert split_plan(batch=1, num_kv_heads=8, table_width=64, block_size=16) == SplitPlan(16, 1)  # a tile each
    assert split_plan(batch=256, num_kv_heads=8, table_width=3, block_size=16).num_splits == 1


def test_interpreted_kernel_equals_references_on_cpu():
    run_interpreted("tests.engine.triton_decode_checks", "interpreted kernel checks passed")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_cuda_kernel_equals_fp64_reference(dtype, tolerance):
    from engine.kernels import triton_decode

    check_exact(triton_decode, "cuda", dtype, tolerance)


@pytest.mark.cuda
def test_cuda_kernel_equals_pytorch_quantized_path():
    from engine.kernels import triton_decode

    check_quantized(triton_decode, "cuda", ["int8", "fp8"])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])
def test_cuda_fused_elementwise_kernels_equal_pytorch(dtype, tolerance):
    check_fused("cuda", dtype, tolerance)
