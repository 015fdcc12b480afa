"""Quantized weights on one GPU: the Triton kernels (int8 per channel, int4 group-wise, fp8 block-scaled)
against bf16 cuBLAS and their widen-then-matmul paths, per layer shape and in the engine's decode step,
same run.

1. Matmuls of a 1B-class Llama's layer shapes (qkv, o, gate_up, down, LM head) at 1-2048 rows:
   `bf16` (F.linear on bf16 weights), `dequantize` (widen int8 to bf16, then F.linear: the engine's
   path before the kernel) and `triton` (engine/kernels/triton_int8_linear.py, default plan); the same
   pair for int4 (groups of 128, engine/kernels/triton_int4_linear.py) and fp8 (e4m3, 128 x 128 block
   scales stored per row as the engine keeps them, engine/kernels/triton_fp8_linear.py). Each timed as
   a CUDA graph of 20 calls (the engine replays decode steps as graphs: no launch cost).
2. Decode steps of the engine (CUDA graphs, context 1,024) at batch 1 / 16 / 64 and one prefill
   step of 8 x 2,048 tokens: bf16 weights vs int8 weights (tuned plans; and the heuristic's plans
   alone) vs int8 weights and LM head vs int4 weights (rounded at load) vs the checkpoint written as
   FP8 with 128 x 128 blocks (kept in e4m3). Tuned int8 plans: benchmarks/tune_int8_linear.py.

Needs CUDA. `python -m benchmarks.bench_gpu_int8_linear --out int8_linear.json`
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.bench_gpu_decode import LLAMA_1B, build_checkpoint, decode_step, prefill_step, timed_ms
from engine.config import EngineConfig
from engine.kernels import triton_int8_linear
from engine.kernels.triton_fp8_linear import fp8_linear
from engine.kernels.triton_int4_linear import int4_linear
from engine.kernels.triton_int8_linear import int8_linear
from engine.layers import fp8_matmul, int4_matmul
from engine.layers.int8_matmul import _dequantize
from engine.layers.quantization import quantize_per_channel
from engine.llm_engine import LLMEngine
from engine.quantization.fp8 import Fp8Format
from engine.quantization.rtn import rtn_quantize
from engine.quantization.writer import write_rtn

HIDDEN, INTER = LLAMA_1B["hidden_size"], LLAMA_1B["intermediate_size"]
QKV = (LLAMA_1B["num_attention_heads"] + 2 * LLAMA_1B["num_key_value_heads"]) * LLAMA_1B["head_dim"]
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER),
          "lm_head": (LLAMA_1B["vocab_size"], HIDDEN)}  # fmt: skip
CALLS_PER_GRAPH = 20
INT4_GROUP_SIZE = 128
FP8_BLOCK = 128


def graph_us(fn) -> float:
    """Microseconds per call of `fn`, replayed as a CUDA graph of CALLS_PER_GRAPH calls."""
    fn()  # compiles / warms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    return timed_ms(graph.replay, repeats=15) * 1e3 / CALLS_PER_GRAPH


def layer_weights(out_features: int, in_features: int) -> dict:
    wide = torch.randn(out_features, in_features, device="cuda") * 0.02
    values, scale = quantize_per_channel(wide)
    q, scales, zeros = rtn_quantize(wide.float().cpu(), 4, INT4_GROUP_SIZE, sym=False)
    fp8 = Fp8Format(block_size=(FP8_BLOCK, FP8_BLOCK)).rtn_parts(wide.float().cpu())
    fp8_scale = fp8["weight_scale_inv"].repeat_interleave(FP8_BLOCK, dim=0)[:out_features]  # per row, as kept
    int4 = (int4_matmul.pack_int4(q), scales.t().contiguous(), zeros.float().t().contiguous())
    return {"bf16": wide.bfloat16(), "int8": values, "scale": scale, "int4": tuple(t.cuda() for t in int4),
            "fp8": (fp8["weight"].cuda(), fp8_scale.contiguous().cuda())}  # fmt: skip


def layer_row(name: str, rows: int, w: dict, dtype: torch.dtype) -> dict:
    x = torch.randn(rows, w["int8"].shape[1], device="cuda", dtype=dtype)
    wide = w["bf16"].to(dtype)
    fp8, fp8_scale = w["fp8"]
    row: dict[str, Any] = {"layer": name, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
           "dense_us": graph_us(lambda: F.linear(x, wide)),
           "dequantize_us": graph_us(lambda: _dequantize(x, w["int8"], w["scale"])),
           "triton_us": graph_us(lambda: int8_linear(x, w["int8"], w["scale"])),
           "int4_dequantize_us": graph_us(lambda: int4_matmul._dequantize(x, *w["int4"])),
           "int4_triton_us": graph_us(lambda: int4_linear(x, *w["int4"])),
           "fp8_dequantize_us": graph_us(lambda: fp8_matmul._dequantize(x, fp8, fp8_scale, FP8_BLOCK)),
           "fp8_triton_us": graph_us(lambda: fp8_linear(x, fp8, fp8_scale, (1, FP8_BLOCK)))}  # fmt: skip
    for prefix in ("", "int4_", "fp8_"):
        row[f"{prefix}triton_vs_dense"] = row["dense_us"] / row[f"{prefix}triton_us"]
        row[f"{prefix}triton_vs_dequantize"] = row[f"{prefix}dequantize_us"] / row[f"{prefix}triton_us"]
    print(f"{name:8s} rows {rows:5d} {row['dtype']}: dense {row['dense_us']:8.1f} us, dequantize "
          f"{row['dequantize_us']:8.1f}, triton {row['triton_us']:8.1f} -> {row['triton_vs_dense']:.2f}x "
          f"dense, {row['triton_vs_dequantize']:.2f}x dequantize; int4 {row['int4_triton_vs_dense']:.2f}x, "
          f"fp8 {row['fp8_triton_vs_dense']:.2f}x dense", flush=True)  # fmt: skip
    return row


def matmul_rows(rows_list, dtype) -> list[dict]:
    out: list[dict] = []
    for name, (n, k) in SHAPES.items():
        w = layer_weights(n, k)
        out.extend(layer_row(name, rows, w, dtype) for rows in rows_list)
    return out


def engine_config_rows(model_dir: Path, label: str, extra: dict, batches, context: int) -> list[dict]:
    blocks = max(batches) * -(-context // 16) + 8 * 2048 // 16 + 64
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), device="cuda", max_num_seqs=max(batches),
                                    max_model_len=max(2048, context), num_kv_blocks=blocks,
                                    max_num_batched_tokens=16384, prefill_chunk_tokens=2048, **extra))  # fmt: skip
    runner = engine.runner
    runner.kv_cache.values.normal_()
    out = []
    for batch in batches:
        step = decode_step(batch, context, runner.block_size)
        ms = timed_ms(lambda step=step: runner.execute(step), repeats=50)
        out.append({"config": label, "step": f"decode b{batch}", "ms": ms})
        print(f"engine {label:13s} decode batch {batch:3d} ctx {context}: {ms:.3f} ms", flush=True)
    prefill = prefill_step(8, 2048, runner.block_size)
    ms = timed_ms(lambda: runner.execute(prefill), repeats=10)
    out.append({"config": label, "step": "prefill 8x2048", "ms": ms})
    print(f"engine {label:13s} prefill 8 x 2048: {ms:.3f} ms", flush=True)
    return out


def engine_rows(model_dir: Path, fp8_dir: Path, batches, context: int) -> list[dict]:
    configs: dict[str, dict] = {"bf16": {}, "int8": {"quantization": "int8"},
               "int8 heuristic": {"quantization": "int8"},
               "int8+lm_head": {"quantization": "int8", "quantize_lm_head": True},
               "int4": {"quantization": "int4"}, "fp8 checkpoint": {}}  # fmt: skip
    out = []
    tuned = triton_int8_linear._tuned_table
    for label, extra in configs.items():
        triton_int8_linear._tuned_table = dict if label == "int8 heuristic" else tuned  # type: ignore[assignment]
        directory = fp8_dir if label == "fp8 checkpoint" else model_dir
        out.extend(engine_config_rows(directory, label, extra, batches, context))
        torch.cuda.empty_cache()
    triton_int8_linear._tuned_table = tuned
    base = {r["step"]: r["ms"] for r in out if r["config"] == "bf16"}
    for r in out:
        r["speedup_vs_bf16"] = base[r["step"]] / r["ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="int8_linear.json")
    parser.add_argument("--rows", default="1,4,16,32,64,128,256,512,2048")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: matmul,fp32,engine")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    started = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    rows = [int(r) for r in args.rows.split(",")]
    if "matmul" not in skip:
        result["matmul_bf16"] = matmul_rows(rows, torch.bfloat16)
    if "fp32" not in skip:
        result["matmul_fp32"] = matmul_rows([1, 16, 64], torch.float32)
    if "engine" not in skip:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_checkpoint(Path(tmp) / "llama-1b")
            fp8_dir = write_rtn(model_dir, Path(tmp) / "llama-1b-fp8", Fp8Format(block_size=(FP8_BLOCK, FP8_BLOCK)))
            batches = [int(b) for b in args.batches.split(",")]
            result["engine"] = engine_rows(model_dir, fp8_dir, batches, 1024)
    result["elapsed_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
