"""The skinny fp32 linear kernel: equal to F.linear (up to summation order) for every row count and
shape it takes, odd sizes included; the cases it does not take go to F.linear unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import kernel
from engine.layers import dense_matmul
from engine.layers.dense_matmul import dense_linear


def test_the_kernel_builds_here():
    assert kernel("fp32_linear") is not None, "the C kernel must build on this machine (cc is required)"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("out_features, in_features", [(64, 64), (37, 50), (130, 7), (5, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    assert dense_matmul._skinny_applies(x, weight)
    # fp32 sums of `in_features` products in another order: within a few ulps of the sum's magnitude.
    torch.testing.assert_close(dense_linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_leading_dims_and_threads_are_kept():
    x, weight = torch.randn(2, 3, 40), torch.randn(24, 40)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            torch.testing.assert_close(dense_linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "x, weight",
    [
        (torch.randn(9, 16), torch.randn(8, 16)),  # many rows: BLAS's GEMM
        (torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)),
        (torch.randn(4, 16), torch.randn(16, 8).t()),  # a non-contiguous weight
    ],
)
def test_other_cases_are_f_linear_exactly(x, weight):
    assert not dense_matmul._skinny_applies(x.reshape(-1, x.shape[-1]), weight)
    assert torch.equal(dense_linear(x, weight), F.linear(x, weight))
