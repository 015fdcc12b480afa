"""MLA's latent KV through the hand-off, against per-head K/V of a model of the same hidden size.

`python -m benchmarks.bench_mla_handoff [--lengths 2048 8192] [--json PATH]` (inside scripts/in_sandbox.sh).
Two real processes hold bf16 KV caches (`engine.kv_storage.KVCacheStorage`) of 27 layers, hidden 2048 (16
heads x 128): MLA as DeepSeek-V2-Lite stores it (one latent of kv_lora_rank 512 + rope 64 per token and
layer), GQA with 8 KV heads and MHA with 16 (K and V per head). The sender runs `send_sequence_kv`,
the receiver `recv_sequence_kv` into its reserved blocks. Reported per layout: KV bytes per token,
and per prompt length the payload and the hand-off's wall time from the first send to the ack (median
of `--repeats`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from kvtransfer.handoff import HandoffTarget, RankTarget, recv_header, recv_sequence_kv, send_sequence_kv
from kvtransfer.store import create_rendezvous_store
from kvtransfer.torch_dist import TorchDistTransport

LAYERS, BLOCK_SIZE = 27, 16
# layout → (KV heads, head_dim, planes): MLA's latent is one "head" of kv_lora_rank + rope dims, stored once.
LAYOUTS = {"mla": (1, 512 + 64, 1), "gqa-8kv": (8, 128, 2), "mha-16kv": (16, 128, 2)}
MOVED = ("mla", "gqa-8kv")  # the layouts whose hand-off is timed (MHA's bytes are reported only)
SENDER, RECEIVER = "bench-prefill", "bench-decode/rank0"


def _cache(layout: str, num_blocks: int, fill: bool) -> KVCacheStorage:
    heads, head_dim, planes = LAYOUTS[layout]
    cache = KVCacheStorage(
        kv_format("auto", torch.bfloat16), LAYERS, heads, num_blocks, BLOCK_SIZE, head_dim, planes=planes
    )
    if fill:
        cache.values.normal_()
    return cache


def _receiver(port: int, lengths: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    transport = TorchDistTransport(RECEIVER, "127.0.0.1", port)
    transport.recv(SENDER, [torch.empty(1)], 60)  # the channel is created outside the timing
    for layout in MOVED:
        cache = _cache(layout, max(lengths) // BLOCK_SIZE, fill=False)
        for length in lengths:
            blocks = tuple(range(length // BLOCK_SIZE))
            for _ in range(repeats):
                header = recv_header(transport, SENDER, time.time() + 120)
                recv_sequence_kv(transport, cache, SENDER, header, blocks, time.time() + 120)
    transport.close()


def _sender(port: int, lengths: list[int], repeats: int) -> list[dict]:
    transport = TorchDistTransport(SENDER, "127.0.0.1", port)
    transport.send(RECEIVER, [torch.zeros(1)], 60)
    rows = []
    for layout in MOVED:
        cache = _cache(layout, max(lengths) // BLOCK_SIZE, fill=True)
        for length in lengths:
            blocks = tuple(range(length // BLOCK_SIZE))
            times_s, num_bytes = [], 0
            for _ in range(repeats):
                ranks = (RankTarget(RECEIVER, 0, cache.num_kv_heads),)
                target = HandoffTarget("bench", ranks, blocks, time.time() + 120)
                started_s = time.perf_counter()
                num_bytes = send_sequence_kv(transport, cache, blocks, length, f"req-{layout}-{length}", target)
                times_s.append(time.perf_counter() - started_s)
            rows.append(
                {
                    "layout": layout,
                    "prompt_tokens": length,
                    "bytes": num_bytes,
                    "handoff_ms": statistics.median(times_s) * 1e3,
                }
            )
    transport.close()
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bytes_per_token = {
        layout: _cache(layout, 1, fill=False).bytes_per_token for layout in LAYOUTS
    }  # all layers, bf16, as the hand-off moves them
    rendezvous = create_rendezvous_store()
    receiver = mp.get_context("spawn").Process(target=_receiver, args=(rendezvous.port, args.lengths, args.repeats))
    receiver.start()
    try:
        rows = _sender(rendezvous.port, args.lengths, args.repeats)
    finally:
        receiver.join(300)
        if receiver.is_alive():
            receiver.kill()
    result = {"bytes_per_token": bytes_per_token, "handoffs": rows}
    for layout, size in bytes_per_token.items():
        print(f"{layout:>9}: {size:>8} KV bytes/token ({size / bytes_per_token['mla']:.2f}x MLA)")
    for row in rows:
        print(
            f"{row['layout']:>9} {row['prompt_tokens']:>6} tokens: {row['bytes'] / 1e6:8.1f} MB "
            f"{row['handoff_ms']:9.1f} ms"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
