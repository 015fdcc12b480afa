"""Hand-off latency: one sequence's prompt KV from a prefill process to a decode process, end to end.

`python -m benchmarks.bench_handoff [--kv-cache-dtypes auto,int8,fp8]` (inside scripts/in_sandbox.sh).
Two real processes hold demo-model-shaped KV caches (`engine.kv_storage.KVCacheStorage`, 12 layers x
4 KV heads x head_dim 64, fp32 model); the sender runs `send_sequence_kv` (header, one message per
layer, ack) and the receiver `recv_sequence_kv` into its reserved blocks. Reported per KV dtype and
prompt length: wall time from the first send to the ack (median of `--repeats`), the payload (values
and, for int8 / fp8, their scales, sent as stored) and its effective GB/s — next to a raw send/recv of
one tensor of the same bytes, in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from kvtransfer.handoff import HandoffTarget, RankTarget, recv_header, recv_sequence_kv, send_sequence_kv
from kvtransfer.store import create_rendezvous_store
from kvtransfer.torch_dist import TorchDistTransport

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16  # the demo model's KV shape
SENDER, RECEIVER = "bench-prefill", "bench-decode/rank0"


def _cache(kv_cache_dtype: str, num_blocks: int) -> KVCacheStorage:
    cache = KVCacheStorage(kv_format(kv_cache_dtype, torch.float32), LAYERS, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
    slots = torch.arange(num_blocks * BLOCK_SIZE)
    for layer in range(LAYERS):
        cache.layer(layer).write(
            torch.randn(len(slots), KV_HEADS, HEAD_DIM), torch.randn(len(slots), KV_HEADS, HEAD_DIM), slots
        )
    return cache


def _receiver(port: int, dtypes: list[str], lengths: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    transport = TorchDistTransport(RECEIVER, "127.0.0.1", port)
    transport.recv(SENDER, [torch.empty(1)], 60)  # the channel is created outside the timing
    for kv_cache_dtype in dtypes:
        cache = _cache(kv_cache_dtype, max(lengths) // BLOCK_SIZE + 1)
        for length in lengths:
            blocks = tuple(range(length // BLOCK_SIZE))
            for _ in range(repeats):
                header = recv_header(transport, SENDER, time.time() + 60)
                recv_sequence_kv(transport, cache, SENDER, header, blocks, time.time() + 60)
                raw = torch.empty(cache.bytes_per_block * len(blocks), dtype=torch.uint8)
                transport.recv(SENDER, [raw], 60)  # the baseline: one tensor, same bytes
    transport.close()


def _sender(port: int, dtypes: list[str], lengths: list[int], repeats: int) -> list[dict]:
    transport = TorchDistTransport(SENDER, "127.0.0.1", port)
    transport.send(RECEIVER, [torch.zeros(1)], 60)
    rows: list[dict] = []
    for kv_cache_dtype in dtypes:
        cache = _cache(kv_cache_dtype, max(lengths) // BLOCK_SIZE + 1)
        rows.extend(_measure(transport, cache, kv_cache_dtype, length, repeats) for length in lengths)
    transport.close()
    return rows


def _measure(transport, cache: KVCacheStorage, kv_cache_dtype: str, length: int, repeats: int) -> dict:
    blocks = tuple(range(length // BLOCK_SIZE))
    handoff_s, raw_s, num_bytes = [], [], 0
    for _ in range(repeats):
        target = HandoffTarget("bench", (RankTarget(RECEIVER, 0, KV_HEADS),), blocks, time.time() + 60)
        started_s = time.perf_counter()
        num_bytes = send_sequence_kv(transport, cache, blocks, length, f"req-{length}", target)
        handoff_s.append(time.perf_counter() - started_s)
        raw = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
        started_s = time.perf_counter()
        transport.send(RECEIVER, [raw], 60)
        raw_s.append(time.perf_counter() - started_s)
    return {
        "kv_cache_dtype": kv_cache_dtype,
        "prompt_tokens": length,
        "bytes": num_bytes,
        "handoff_ms": statistics.median(handoff_s) * 1e3,
        "raw_send_ms": statistics.median(raw_s) * 1e3,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--kv-cache-dtypes", default="auto,int8,fp8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtypes = args.kv_cache_dtypes.split(",")
    rendezvous = create_rendezvous_store()
    context = mp.get_context("spawn")
    receiver = context.Process(target=_receiver, args=(rendezvous.port, dtypes, args.lengths, args.repeats))
    receiver.start()
    try:
        rows = _sender(rendezvous.port, dtypes, args.lengths, args.repeats)
    finally:
        receiver.join(120)
        if receiver.is_alive():
            receiver.kill()
    _print(rows)
    return rows


def _print(rows: list[dict]) -> None:
    auto = {row["prompt_tokens"]: row for row in rows if row["kv_cache_dtype"] == "auto"}
    print(
        f"{'kv dtype':>9}{'prompt tokens':>14}{'KV MB':>9}{'x auto':>8}{'hand-off ms':>13}{'x auto':>8}{'GB/s':>7}"
        f"{'raw send ms':>13}"
    )
    for row in rows:
        base = auto.get(row["prompt_tokens"])
        bytes_x = row["bytes"] / base["bytes"] if base else float("nan")
        time_x = row["handoff_ms"] / base["handoff_ms"] if base else float("nan")
        gbps = row["bytes"] / row["handoff_ms"] / 1e6
        print(
            f"{row['kv_cache_dtype']:>9}{row['prompt_tokens']:>14}{row['bytes'] / 1e6:>9.1f}{bytes_x:>8.3f}"
            f"{row['handoff_ms']:>13.1f}{time_x:>8.2f}{gbps:>7.2f}{row['raw_send_ms']:>13.1f}"
        )


if __name__ == "__main__":
    main()
