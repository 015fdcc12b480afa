"""Prefill steps on one GPU: the Triton paged prefill kernel against one SDPA call per chunk, same run.

For each shape (chunks per step x new tokens per chunk, after a cached prefix of `cached` tokens), the
model's whole step (`ModelRunner.execute`) is timed with the kernel (one launch per layer for every
chunk, engine/kernels/triton_prefill.py) and with the per-chunk path (a gather of each chunk's
context and an SDPA call per chunk and layer), the two arms alternating round by round. Prints the
median milliseconds of each and their ratio (per-chunk over kernel: above 1 means the kernel is faster).

Needs CUDA. `python -m benchmarks.bench_gpu_prefill [--shapes 64x16+1024,...] [--dtype bfloat16] --out r.json`
A 1B-class Llama (Llama-3.2-1B's shape, random weights: benchmarks/bench_gpu_decode.py) unless `--checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_gpu_decode import build_checkpoint, prefill_step
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

DEFAULT_SHAPES = "1x2048+0,8x2048+0,1x16+1024,16x16+1024,64x16+1024,64x16+4096,16x256+2048,4x512+8192"


def parse_shape(text: str) -> tuple[int, int, int]:
    """'64x16+1024' -> (64 chunks, 16 new tokens each, 1024 cached tokens before them)."""
    chunks, rest = text.split("x")
    new, cached = rest.split("+")
    return int(chunks), int(new), int(cached)


def _timed_ms(fn) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def compare(engine: LLMEngine, shape: tuple[int, int, int], rounds: int) -> dict:
    runner = engine.runner
    kernel_rows = runner.prefill_rows_per_tile
    chunks, new, cached = shape
    step = prefill_step(chunks, new, runner.block_size, cached)
    times: dict[str, list[float]] = {"kernel": [], "per_chunk": []}
    arms = {"kernel": kernel_rows, "per_chunk": 0}
    for round_index in range(rounds + 1):  # round 0 warms both arms up (compiles the kernel's variant)
        order = list(arms) if round_index % 2 == 0 else list(reversed(arms))
        for arm in order:
            runner.prefill_rows_per_tile = arms[arm]
            ms = _timed_ms(lambda: runner.execute(step))
            if round_index:
                times[arm].append(ms)
    runner.prefill_rows_per_tile = kernel_rows
    kernel, per_chunk = (statistics.median(times[a]) for a in ("kernel", "per_chunk"))
    print(
        f"{chunks:3d} chunks x {new:5d} new after {cached:5d} cached: kernel {kernel:8.2f} ms, "
        f"per-chunk {per_chunk:8.2f} ms, ratio {per_chunk / kernel:5.2f}x",
        flush=True,
    )
    return {"chunks": chunks, "new": new, "cached": cached, "kernel_ms": kernel, "per_chunk_ms": per_chunk,
            "ratio": per_chunk / kernel}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--checkpoint", default="", help="an existing checkpoint dir (default: build a 1B Llama)")
    parser.add_argument("--out", default="gpu_prefill.json")
    args = parser.parse_args()
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.checkpoint) if args.checkpoint else build_checkpoint(Path(tmp) / "llama-1b")
        longest = max(c + n for _, n, c in shapes)
        blocks = max(chunks * -(-(c + n) // 16) for chunks, n, c in shapes) + 64
        engine = LLMEngine(
            EngineConfig(model_dir=str(model_dir), device="cuda", dtype=args.dtype, max_num_seqs=64,
                         max_model_len=max(2048, longest), num_kv_blocks=blocks, max_num_batched_tokens=16384,
                         prefill_chunk_tokens=2048, cuda_graphs=False)
        )  # fmt: skip
        rows = [compare(engine, shape, args.rounds) for shape in shapes]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
