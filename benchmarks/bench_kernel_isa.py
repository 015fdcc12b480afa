"""The C linear kernels per instruction-set variant (engine/kernels/isa.py) on this CPU, in one run.

`python -m benchmarks.bench_kernel_isa [--rows 1,8] [--threads N] [--repeats R] [--json PATH]`. The
weights are all linear layers of the demo model, as in benchmarks/bench_int4_matmul.py (int4 in groups
of 128, and per-channel int8). Each figure is the median over `--repeats` passes over every layer, in
microseconds; the variants take turns within each repeat, so load on a shared machine falls on all
of them alike. Ratios are against the `generic` variant (the x86-64 baseline) measured in the same run.
Only the variants this CPU runs are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.bench_int4_matmul import _layers
from benchmarks.bench_quant_perplexity import cpu_name
from engine import kernels
from engine.kernels import isa

KERNELS = ("int4_linear", "int8_linear")


def _int4(function, x: torch.Tensor, layer: dict, out: torch.Tensor) -> None:
    packed, scale = layer["int4"], layer["int4_scale"]
    k = packed.shape[1] * 2
    args = (x.shape[0], packed.shape[0], k, k // scale.shape[1], torch.get_num_threads())
    if function(
        x.data_ptr(), packed.data_ptr(), scale.data_ptr(), layer["int4_zero"].data_ptr(), out.data_ptr(), *args
    ):
        raise RuntimeError("int4 kernel failed")


def _int8(function, x: torch.Tensor, layer: dict, out: torch.Tensor) -> None:
    weight = layer["int8"]
    args = (x.shape[0], weight.shape[0], weight.shape[1], torch.get_num_threads())
    if function(x.data_ptr(), weight.data_ptr(), layer["int8_scale"].data_ptr(), out.data_ptr(), *args):
        raise RuntimeError("int8 kernel failed")


CALLERS: dict[str, Callable] = {"int4_linear": _int4, "int8_linear": _int8}


def _pass_s(name: str, variant: str, layers: list[dict], inputs: dict, outputs: list) -> float:
    function, call = kernels.kernel(name, variant), CALLERS[name]
    started_s = time.perf_counter()
    for layer, out in zip(layers, outputs, strict=True):
        call(function, inputs[layer["fp32"].shape[1]], layer, out)
    return time.perf_counter() - started_s


def measure(layers: list[dict], rows: int, variants: list[str], repeats: int) -> dict[str, dict[str, float]]:
    """kernel → variant → median microseconds per pass over all layers."""
    inputs = {layer["fp32"].shape[1]: torch.randn(rows, layer["fp32"].shape[1]) for layer in layers}
    outputs = [torch.empty(rows, layer["fp32"].shape[0]) for layer in layers]
    passes: dict[tuple[str, str], list[float]] = {(n, v): [] for n in KERNELS for v in variants}
    for name in KERNELS:
        for variant in variants:
            _pass_s(name, variant, layers[:4], inputs, outputs[:4])  # build, load, warm up
    for _ in range(repeats):
        for name in KERNELS:
            for variant in variants:
                passes[(name, variant)].append(_pass_s(name, variant, layers, inputs, outputs))
    return {n: {v: statistics.median(passes[(n, v)]) * 1e6 for v in variants} for n in KERNELS}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8", help="activation rows (tokens), comma-separated")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = [v.name for v in isa.supported_variants()]
    load_average_start = os.getloadavg()[0]
    layers = _layers()
    print(f"{len(layers)} demo-model linear layers, {args.threads} threads, variants {variants}")
    print(f"median us per pass (ratio: generic / variant){'':>4}" + "".join(f"{v:>20}" for v in variants))
    results: dict[str, dict[str, dict[str, float]]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        results[str(rows)] = figures = measure(layers, rows, variants, args.repeats)
        for name, times in figures.items():
            cells = "".join(f"{t:>10.0f} ({times['generic'] / t:4.2f}x)  " for t in times.values())
            print(f"{name:>15} rows={rows:<4}{'':>20}{cells}", flush=True)
    report = {
        "benchmark": "kernel_isa",
        "machine": cpu_name(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "variants": variants,
        "threads": args.threads,
        "repeats": args.repeats,
        "load_average_1min": {"start": load_average_start, "end": os.getloadavg()[0]},
        "us_per_pass": {
            r: {n: {v: round(t) for v, t in f.items()} for n, f in fig.items()} for r, fig in results.items()
        },
        "speedup_vs_generic": {
            r: {n: {v: round(f["generic"] / t, 3) for v, t in f.items()} for n, f in fig.items()}
            for r, fig in results.items()
        },
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
