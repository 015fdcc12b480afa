"""Hand-off latency: one sequence's prompt KV from a prefill process to a decode process, end to end.

`python -m benchmarks.bench_handoff` (inside scripts/in_sandbox.sh). Two real processes hold
demo-model-shaped KV caches (`[layers, 2, kv_heads, blocks, block_size, head_dim]`); the sender runs
`send_sequence_kv` (header, one message per layer, ack) and the receiver `recv_sequence_kv` into its
reserved blocks. Reported: wall time from the first send to the ack, per prompt length, the payload
and its effective GB/s — next to a raw send/recv of one tensor of the same bytes, in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from kvtransfer.handoff import HandoffTarget, RankTarget, recv_header, recv_sequence_kv, send_sequence_kv
from kvtransfer.store import create_rendezvous_store
from kvtransfer.torch_dist import TorchDistTransport

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16  # the demo model's KV shape
SENDER, RECEIVER = "bench-prefill", "bench-decode/rank0"


def _cache(num_blocks: int) -> torch.Tensor:
    return torch.randn(LAYERS, 2, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)


def _receiver(port: int, lengths: list[int], repeats: int, results) -> None:
    torch.set_num_threads(1)
    transport = TorchDistTransport(RECEIVER, "127.0.0.1", port)
    cache = _cache(max(lengths) // BLOCK_SIZE + 1)
    for length in lengths:
        blocks = tuple(range(length // BLOCK_SIZE))
        for _ in range(repeats):
            header = recv_header(transport, SENDER, time.time() + 60)
            recv_sequence_kv(transport, cache, SENDER, header, blocks, time.time() + 60)
            raw = torch.empty(LAYERS * 2 * KV_HEADS * len(blocks) * BLOCK_SIZE * HEAD_DIM)
            transport.recv(SENDER, [raw], 60)  # the baseline: one tensor, same bytes
    transport.close()


def _sender(port: int, lengths: list[int], repeats: int) -> list[dict]:
    transport = TorchDistTransport(SENDER, "127.0.0.1", port)
    cache = _cache(max(lengths) // BLOCK_SIZE + 1)
    rows = []
    for length in lengths:
        blocks = tuple(range(length // BLOCK_SIZE))
        target = HandoffTarget("bench", (RankTarget(RECEIVER, 0, KV_HEADS),), blocks, 0.0)
        handoff_s, raw_s, num_bytes = [], [], 0
        for _ in range(repeats):
            target = HandoffTarget("bench", target.ranks, blocks, time.time() + 60)
            started_s = time.perf_counter()
            num_bytes = send_sequence_kv(transport, cache, blocks, length, f"req-{length}", target)
            handoff_s.append(time.perf_counter() - started_s)
            raw = torch.randn(num_bytes // 4)
            started_s = time.perf_counter()
            transport.send(RECEIVER, [raw], 60)
            raw_s.append(time.perf_counter() - started_s)
        rows.append({"prompt_tokens": length, "bytes": num_bytes, "handoff_ms": statistics.median(handoff_s) * 1e3,
                     "raw_send_ms": statistics.median(raw_s) * 1e3})
    transport.close()
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rendezvous = create_rendezvous_store()
    context = mp.get_context("spawn")
    receiver = context.Process(target=_receiver, args=(rendezvous.port, args.lengths, args.repeats, None))
    receiver.start()
    try:
        rows = _sender(rendezvous.port, args.lengths, args.repeats)
    finally:
        receiver.join(120)
        if receiver.is_alive():
            receiver.kill()
    print(f"{'prompt tokens':>14}{'KV MB':>10}{'hand-off ms':>13}{'GB/s':>8}{'raw send ms':>13}{'ratio':>8}")
    for row in rows:
        gbps = row["bytes"] / row["handoff_ms"] / 1e6
        print(f"{row['prompt_tokens']:>14}{row['bytes'] / 1e6:>10.1f}{row['handoff_ms']:>13.1f}{gbps:>8.2f}"
              f"{row['raw_send_ms']:>13.1f}{row['raw_send_ms'] / row['handoff_ms']:>8.2f}")
    return rows


if __name__ == "__main__":
    main()
