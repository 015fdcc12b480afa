"""Sliding-window vs full attention over a long paged context, per layer, on CPU.

`python -m benchmarks.bench_sliding_window [--contexts 4096 16384] [--window 1024] [--json PATH]` (inside
scripts/in_sandbox.sh). One layer of Mistral-7B's attention shape (32 query heads, 8 KV heads, head_dim
128), fp32, through `engine.attention.paged_attention` as the engine calls it:
- `decode`: `--batch` decode rows, each over `context` cached tokens, through the native C kernel;
- `prefill`: one `--chunk`-token prefill chunk after `context` cached tokens (chunked prefill, a
  prefix hit), through the PyTorch path.
Each is timed with the layer's window (`--window` tokens, the kernels and the prefill skip the blocks
before it) and without (the whole context), the two arms alternating step by step in one run.
Reported: the median time of each arm over `--steps` steps (after 2 warm-up steps) and full / windowed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, PrefillSegment, paged_attention
from engine.kernels import decode_attention_kernel
from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _cache(num_blocks: int) -> KVCacheStorage:
    cache = KVCacheStorage(kv_format("auto", torch.float32), 1, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    for plane in (cache.layer(0).k, cache.layer(0).v):
        plane.copy_(torch.randn(plane.shape, generator=gen))
    return cache


def _decode_case(batch: int, context: int):
    blocks = -(-(context + 1) // BLOCK_SIZE)
    cache = _cache(batch * blocks)
    tables = torch.arange(batch * blocks, dtype=torch.int64).view(batch, blocks)
    lens = torch.full((batch,), context + 1, dtype=torch.int64)
    slots = tables[:, context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE  # the new token's slot
    meta = AttentionMetadata(slots, batch, tables, lens, None, None, ())
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(batch, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    return cache, meta, q, k, v


def _prefill_case(chunk: int, context: int):
    total = context + chunk
    blocks = -(-total // BLOCK_SIZE)
    cache = _cache(blocks)
    all_slots = torch.arange(total, dtype=torch.int64)
    meta = AttentionMetadata(
        all_slots[context:], 0, torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), None, None,
        (PrefillSegment(0, chunk, total, all_slots),),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(chunk, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(chunk, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    return cache, meta, q, k, v


@torch.inference_mode()
def _measure(case, window: int, steps: int) -> dict:
    cache, meta, q, k, v = case
    layer = cache.layer(0)
    arms = {"full": None, "windowed": window}
    times_s: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(steps + 2):  # two warm-up steps; the arms alternate so load drifts hit both
        for arm, arm_window in arms.items():
            start = time.perf_counter()
            paged_attention(q, k, v, layer, meta, HEAD_DIM**-0.5, arm_window)
            times_s[arm].append(time.perf_counter() - start)
    full_ms, windowed_ms = (statistics.median(times_s[arm][2:]) * 1e3 for arm in arms)
    return {"full_ms": full_ms, "windowed_ms": windowed_ms, "full_over_windowed": full_ms / windowed_ms}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="decode rows")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if decode_attention_kernel() is None:
        raise SystemExit("the C decode kernel could not be built (a C compiler is required)")
    torch.set_num_threads(args.threads)
    rows = []
    for context in args.contexts:
        for kind, case in (
            ("decode", _decode_case(args.batch, context)),
            ("prefill", _prefill_case(args.chunk, context)),
        ):
            row = {"kind": kind, "context": context, **_measure(case, args.window, args.steps)}
            rows.append(row)
            print(
                f"{kind:8s} context {context:6d}: full {row['full_ms']:9.2f} ms, windowed {row['windowed_ms']:8.2f} ms,"
                f" {row['full_over_windowed']:.1f}x"
            )
    result = {
        "benchmark": "sliding_window",
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
        "window": args.window,
        "batch": args.batch,
        "chunk": args.chunk,
        "steps": args.steps,
        "threads": args.threads,
        "rows": rows,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
