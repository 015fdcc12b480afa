"""Group-wise int4 and int8 matmuls on this CPU against fp32 `F.linear` and the int8 kernel, same run.

`python -m benchmarks.bench_int4_matmul [--rows 1,2,4,8,16,32] [--threads N] [--json PATH]`. The
weights are all linear layers of the demo model (12 layers x qkv / o / gate_up / down: 75.5 M weights),
so each pass streams them from memory as a decode step does; each figure is the median of `--repeats`
passes over all layers, in microseconds. Candidates:
- `int4_native`: engine/kernels/int4_linear.c (nibbles widened in registers, groups of 128);
- `int4_dequantize`: widen the whole weight to fp32, then `F.linear` (what large batches use);
- `int8_native`: engine/kernels/int8_linear.c (per-channel int8, for comparison);
- `int8g_native` / `int8g_dequantize`: group-wise int8 (groups of 128), engine/kernels/int8_group_linear.c
  and its widened path.
The crossover of `int4_native` and `int4_dequantize` sets NATIVE_MAX_ROWS in engine/layers/int4_matmul.py,
that of the two group-wise int8 paths the one in engine/layers/int8_group_matmul.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_quant_perplexity import cpu_name
from engine.layers import int4_matmul, int8_group_matmul, int8_matmul
from engine.layers.quantization import quantize_per_channel
from engine.quantization.rtn import rtn_quantize

HIDDEN, INTERMEDIATE, LAYERS, QKV = 768, 2048, 12, (12 + 2 * 4) * 64  # the demo model
GROUP_SIZE = 128

CANDIDATES = {
    "fp32": lambda x, w: F.linear(x, w["fp32"]),
    "int4_native": lambda x, w: int4_matmul._native(x, w["int4"], w["int4_scale"], w["int4_zero"]),
    "int4_dequantize": lambda x, w: int4_matmul._dequantize(x, w["int4"], w["int4_scale"], w["int4_zero"]),
    "int8_native": lambda x, w: int8_matmul._native(x, w["int8"], w["int8_scale"]),
    "int8g_native": lambda x, w: int8_group_matmul._native(x, w["int8g"], w["int8g_scale"]),
    "int8g_dequantize": lambda x, w: int8_group_matmul._dequantize(x, w["int8g"], w["int8g_scale"]),
}


def _layers() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
    out = []
    for n, k in shapes:
        weight = torch.randn(n, k, generator=gen) * 0.02
        values, scales, zeros = rtn_quantize(weight, 4, GROUP_SIZE, sym=False)
        int8, int8_scale = quantize_per_channel(weight)
        int8g, int8g_scale = int8_group_matmul.quantize_groupwise(weight, GROUP_SIZE)
        out.append(
            {
                "fp32": weight,
                "int4": int4_matmul.pack_int4(values),
                "int4_scale": scales.t().contiguous(),
                "int4_zero": zeros.t().float().contiguous(),
                "int8": int8,
                "int8_scale": int8_scale,
                "int8g": int8g,
                "int8g_scale": int8g_scale,
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
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="activation rows (tokens), comma-separated")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = _layers()
    print(
        f"{len(layers)} demo-model linear layers, {args.threads} threads; median us per pass (ratio: fp32 / candidate)"
    )
    print(f"{'rows':>5}" + "".join(f"{name:>22}" for name in CANDIDATES))
    results: dict[int, dict[str, float]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        times = {name: _time_us(fn, layers, rows, args.repeats) for name, fn in CANDIDATES.items()}
        results[rows] = times
        print(f"{rows:>5}" + "".join(f"{t:>11.0f} ({times['fp32'] / t:4.2f}x)  " for t in times.values()), flush=True)
    report = {
        "benchmark": "int4_matmul",
        "machine": cpu_name(),
        "threads": args.threads,
        "group_size": GROUP_SIZE,
        "us_per_pass": {str(rows): {k: round(v) for k, v in t.items()} for rows, t in results.items()},
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
