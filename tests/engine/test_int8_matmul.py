"""Every int8 matmul backend equals `x @ (int8 weight * scale)ᵀ` computed in float64, on shapes with
ragged tails (rows, output channels not a multiple of 4, input features not a multiple of 16), and
the dispatcher picks the backend the docstring promises."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import kernel
from engine.layers.int8_matmul import BACKENDS, NATIVE_MAX_ROWS, int8_matmul, select_backend
from engine.layers.quantization import quantize_per_channel

SHAPES = [(1, 768, 1280), (3, 37, 5), (4, 16, 4), (17, 100, 33), (64, 64, 130), (65, 48, 12), (200, 96, 72)]


def _case(rows: int, k: int, n: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    values, scale = quantize_per_channel(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen).to(dtype)
    exact = (x.double() @ (values.double() * scale.double()[:, None]).T)
    return x, values, scale, exact


@pytest.mark.parametrize("rows, k, n", SHAPES)
@pytest.mark.parametrize("name", ["native", "dequantize"])
def test_fp32_backends_equal_the_exact_product(name, rows, k, n):
    assert kernel("int8_linear") is not None, "the C kernel must build on this machine (cc is required)"
    backend = next(b for b in BACKENDS if b.name == name)
    x, values, scale, exact = _case(rows, k, n)
    got = backend.run(x, values, scale)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)


def test_bf16_activations_use_int8pack_within_bf16_precision():
    x, values, scale, exact = _case(9, 128, 40, torch.bfloat16)
    assert select_backend(x).name == "int8pack"
    got = int8_matmul(x, values, scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=5e-2)


def test_dispatch_by_rows_and_leading_dimensions_are_kept():
    _, values, scale, _ = _case(1, 32, 8)
    assert select_backend(torch.zeros(NATIVE_MAX_ROWS, 32)).name == "native"
    assert select_backend(torch.zeros(NATIVE_MAX_ROWS + 1, 32)).name == "dequantize"
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(int8_matmul(x, values, scale), int8_matmul(x.view(6, 32), values, scale).view(2, 3, 8))
