"""Smoke test of `benchmarks.bench_kernel_isa` on two small layers: each variant's call computes the layer's
product (the benchmark times the right thing), and every variant this CPU runs gets a time."""

from __future__ import annotations

import torch

from benchmarks import bench_kernel_isa as bench
from engine import kernels
from engine.kernels import isa
from engine.layers.int4_matmul import dequantize_int4, pack_int4
from engine.layers.quantization import quantize_per_channel
from engine.quantization.rtn import rtn_quantize


def _layer(out_features: int, in_features: int, seed: int) -> dict:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    values, scales, zeros = rtn_quantize(weight, 4, 64, sym=False)
    int8, int8_scale = quantize_per_channel(weight)
    return {
        "fp32": weight,
        "int4": pack_int4(values),
        "int4_scale": scales.t().contiguous(),
        "int4_zero": zeros.t().float().contiguous(),
        "int8": int8,
        "int8_scale": int8_scale,
    }


def test_each_variant_computes_the_product_and_is_timed():
    layers = [_layer(24, 128, 0), _layer(40, 64, 1)]
    variants = [v.name for v in isa.supported_variants()]
    x = torch.randn(3, 128)
    for variant in variants:
        out = torch.empty(3, 24)
        bench._int4(kernels.kernel("int4_linear", variant), x, layers[0], out)
        weight = dequantize_int4(layers[0]["int4"], layers[0]["int4_scale"], layers[0]["int4_zero"])
        torch.testing.assert_close(out, x @ weight.t(), rtol=1e-4, atol=1e-4)
        bench._int8(kernels.kernel("int8_linear", variant), x, layers[0], out)
        weight = layers[0]["int8"].float() * layers[0]["int8_scale"][:, None]
        torch.testing.assert_close(out, x @ weight.t(), rtol=1e-4, atol=1e-4)
    figures = bench.measure(layers, rows=2, variants=variants, repeats=1)
    assert set(figures) == set(bench.KERNELS)
    assert all(set(times) == set(variants) and min(times.values()) > 0 for times in figures.values())
