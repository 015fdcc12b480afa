"""Weight-only int8 matmul on this CPU: every candidate against fp32 `F.linear`, same run.

`python -m benchmarks.bench_int8_matmul [--rows 1,4,16,32,64,128,512] [--threads N]`. The weights are
all linear layers of the demo model (12 layers x qkv / o / gate_up / down: 75.5 M weights, 302 MB in fp32),
so each pass streams them from memory as a decode step does; each figure is the median of
`--repeats` passes over all layers, in microseconds. Candidates:
- `native`: engine/kernels/int8_linear.c (int8 widened in registers, fp32 FMA);
- `fp32_native`: engine/kernels/fp32_linear.c on the fp32 weights (what fp32 models use for 2-8 rows:
  engine/layers/dense_matmul.py);
- `dequantize`: widen the whole weight to fp32, then `F.linear` (what large batches use);
- `int8pack_fp32`: `torch.ops.aten._weight_int8pack_mm` with fp32 activations;
- `int8pack_bf16`: the same op with bf16 activations (it is vectorized for bf16; costs activation
  precision, so the engine uses it only for bf16 / fp16 models);
- `int_mm_w8a8`: `torch._int_mm` after quantizing activations per row to int8 (not weight-only:
  listed for the speed it would buy).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.kernels import kernel
from engine.layers.int8_matmul import _dequantize, _native
from engine.layers.quantization import quantize_per_channel

HIDDEN, INTERMEDIATE, LAYERS, QKV = 768, 2048, 12, (12 + 2 * 4) * 64  # the demo model


def _fp32_native(x, weight):
    out = torch.empty(x.shape[0], weight.shape[0])
    status = kernel("fp32_linear")(
        x.data_ptr(), weight.data_ptr(), None, out.data_ptr(), *x.shape[:1], *weight.shape, torch.get_num_threads()
    )
    assert status == 0
    return out


def _int_mm_w8a8(x, weight_t, scale):
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 127
    rows = (x / x_scale).round_().to(torch.int8)
    padded = rows if rows.shape[0] > 16 else torch.cat([rows, rows.new_zeros(17 - rows.shape[0], rows.shape[1])])
    return torch._int_mm(padded, weight_t)[: x.shape[0]].float() * x_scale * scale


CANDIDATES = {
    "fp32": lambda x, w: F.linear(x, w["fp32"]),
    "native": lambda x, w: _native(x, w["int8"], w["scale"]),
    "fp32_native": lambda x, w: _fp32_native(x, w["fp32"]),
    "dequantize": lambda x, w: _dequantize(x, w["int8"], w["scale"]),
    "int8pack_fp32": lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w["int8"], w["scale"]),
    "int8pack_bf16": lambda x, w: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w["int8"], w["scale_bf16"]),
    "int_mm_w8a8": lambda x, w: _int_mm_w8a8(x, w["int8_t"], w["scale"]),
}
SLOW_ABOVE_ROWS = {"int8pack_fp32": 16}  # measured: minutes per pass beyond this


def _layers() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
    out = []
    for n, k in shapes:
        weight = torch.randn(n, k, generator=gen) * 0.02
        values, scale = quantize_per_channel(weight)
        out.append(
            {
                "fp32": weight,
                "int8": values,
                "scale": scale,
                "scale_bf16": scale.bfloat16(),
                "int8_t": values.t().contiguous(),
            }
        )
    return out


def _time_us(fn, layers: list[dict], rows: int, repeats: int) -> float:
    inputs = {layer["fp32"].shape[1]: torch.randn(rows, layer["fp32"].shape[1]) for layer in layers}
    for layer in layers[:4]:
        fn(inputs[layer["fp32"].shape[1]], layer)  # warm-up
    passes = []
    for _ in range(repeats):
        started_s = time.perf_counter()
        for layer in layers:
            fn(inputs[layer["fp32"].shape[1]], layer)
        passes.append(time.perf_counter() - started_s)
    return statistics.median(passes) * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,32,64,128,512", help="activation rows (tokens), comma-separated")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help="columns to run (fp32 always runs)")
    args = parser.parse_args(argv)
    chosen = {"fp32", *args.candidates.split(",")}
    candidates = {name: fn for name, fn in CANDIDATES.items() if name in chosen}
    torch.set_num_threads(args.threads)
    layers = _layers()
    print(
        f"{len(layers)} demo-model linear layers, {args.threads} threads; median us per pass over all layers "
        "(ratio: fp32 time / candidate time, > 1 is faster)"
    )
    print(f"{'rows':>5}" + "".join(f"{name:>22}" for name in candidates))
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        times = {
            name: (None if rows > SLOW_ABOVE_ROWS.get(name, rows) else _time_us(fn, layers, rows, args.repeats))
            for name, fn in candidates.items()
        }
        results[rows] = times
        base = times["fp32"]
        assert base is not None, "fp32 always runs"
        cells = [f"{'skipped':>22}" if t is None else f"{t:>11.0f} ({base / t:4.2f}x)  " for t in times.values()]
        print(f"{rows:>5}" + "".join(cells))
    return results


if __name__ == "__main__":
    main()
