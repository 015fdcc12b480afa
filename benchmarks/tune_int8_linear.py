"""Tunes the Triton int8 linear kernel's launch plans for this GPU and writes them into the table
the engine reads (engine/kernels/int8_linear_plans.json), as vLLM ships tuned MoE configs per GPU.

For each layer shape (`OUTxIN`, default: a 1B-class Llama's qkv / o / gate_up / down) and row bucket
(TUNED_ROWS: a bucket's plan serves every row count up to it), every candidate plan is timed as a
CUDA graph of 20 calls with bf16 activations; the fastest is kept, and the heuristic's time is
printed beside it. Plans depend on shapes only, never on values.

Needs CUDA. `python -m benchmarks.tune_int8_linear [--shapes 3072x2048,...] [--out PATH]`
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from benchmarks.bench_gpu_int8_linear import SHAPES, graph_us, layer_weights
from engine.kernels.triton_int8_linear import PLANS_PATH, TUNED_ROWS, LaunchPlan, heuristic_plan, int8_linear


def candidate_plans(rows: int, k: int) -> list[LaunchPlan]:
    """Tiles, splits over the input features (each split >= 2 tiles) and warps worth timing."""
    block_ms = (16,) if rows <= 16 else (32,) if rows <= 32 else (64,) if rows <= 64 else (64, 128)
    plans: list[LaunchPlan] = []
    for block_m in block_ms:
        for block_n in (32, 64, 128):
            for block_k in (64, 128, 256):
                tiles_k = -(-k // block_k)
                for splits in (1, 2, 4, 8) if k >= 4096 else (1, 2):
                    per = -(-tiles_k // splits)
                    if per < 2 and splits > 1:
                        continue
                    warps = (4, 8) if block_m * block_n >= 64 * 64 else (4,)
                    plans.extend(LaunchPlan(block_m, block_n, block_k, -(-tiles_k // per), per, w) for w in warps)
    return list(dict.fromkeys(plans))


def tune_shape(n: int, k: int, rows: int) -> dict:
    w = layer_weights(n, k)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

    def time_plan(plan: LaunchPlan) -> float:
        return graph_us(lambda: int8_linear(x, w["int8"], w["scale"], plan))

    heuristic = heuristic_plan(rows, n, k)
    heuristic_us = time_plan(heuristic)
    best, best_us = heuristic, heuristic_us
    for plan in candidate_plans(rows, k):
        try:
            us = time_plan(plan)
        except OutOfResources:  # tiles too big for this GPU's shared memory: not a candidate here
            continue
        if us < best_us:
            best, best_us = plan, us
    print(f"{n}x{k} rows {rows:4d}: heuristic {heuristic_us:7.1f} us {tuple(heuristic)}, tuned {best_us:7.1f} us "
          f"{tuple(best)} -> {heuristic_us / best_us:.2f}x", flush=True)  # fmt: skip
    return {"shape": f"{n}x{k}", "rows": rows, "heuristic": list(heuristic), "heuristic_us": heuristic_us,
            "tuned": list(best), "tuned_us": best_us}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_shapes = ",".join(f"{n}x{k}" for name, (n, k) in SHAPES.items() if name != "lm_head")
    parser.add_argument("--shapes", default=default_shapes)
    parser.add_argument("--rows", default=",".join(map(str, TUNED_ROWS)))
    parser.add_argument("--out", default=str(PLANS_PATH), help="table to merge into (default: the engine's)")
    parser.add_argument("--report", default="", help="also write every row's timings here (JSON)")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.cuda.get_device_name()
    out = Path(args.out)
    table = json.loads(out.read_text()) if out.exists() else {}
    rows_list = [int(r) for r in args.rows.split(",")]
    assert set(rows_list) <= set(TUNED_ROWS), f"row buckets are {TUNED_ROWS}"
    report = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for rows in rows_list:
            row = tune_shape(n, k, rows)
            report.append(row)
            table.setdefault(device, {}).setdefault(shape, {})[str(rows)] = row["tuned"]
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{len(report)} plans for {device} in {time.perf_counter() - started:.0f} s -> {out}")
    if args.report:
        Path(args.report).write_text(json.dumps({"device": device, "rows": report}, indent=2))


if __name__ == "__main__":
    main()
