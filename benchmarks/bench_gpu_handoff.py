"""KV hand-off between two processes on one GPU: the transport's cuda_ipc path vs a host-staged copy.

Two spawned processes share cuda:0, each with a `KVCacheStorage` of the 1B Llama shape (16 layers,
8 KV heads, head_dim 64, bf16, block 16). The sender exports one sequence's blocks layer by layer
(`export_layer`) and sends each layer as one message (as the hand-off does; also all layers as one message, to show the
per-message cost); the receiver receives into staging tensors and
writes them into its own blocks (`import_layer`), as the hand-off does. Two ways, in the same run:
- `cuda_ipc`: `TorchDistTransport(backend="auto")`, which agrees on cuda_ipc for two processes on
  one GPU (IPC handles over gloo, a device-to-device copy by the receiver);
- `host-staged`: the same messages copied to host memory, sent over gloo, copied back to the GPU:
  what moving GPU KV costs without IPC (NCCL refuses two ranks on one GPU).
GB/s = KV bytes of the sequence / receiver's wall time from its first recv to its last import
(synchronized), median of the repetitions. Needs CUDA; starts a TCPStore (run sandboxed off-GPU
boxes). `python -m benchmarks.bench_gpu_handoff --out handoff.json`
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16
_SPAWN = multiprocessing.get_context("spawn")


def _storage(num_blocks: int):
    from engine.kv_quant import kv_format
    from engine.kv_storage import KVCacheStorage

    storage = KVCacheStorage(kv_format("auto", torch.bfloat16), LAYERS, KV_HEADS, num_blocks, BLOCK, HEAD_DIM, "cuda")
    storage.values.normal_()
    return storage


def _worker(role: str, mode: str, per_layer: bool, port: int, tokens_list: list[int], repeats: int, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from kvtransfer.torch_dist import TorchDistTransport

    transport = TorchDistTransport(role, "127.0.0.1", port, backend="auto" if mode == "cuda_ipc" else "gloo")
    peer = "receiver" if role == "sender" else "sender"
    max_blocks = max(tokens_list) // BLOCK
    storage = _storage(2 * max_blocks)
    figures = {}
    for tokens in tokens_list:
        blocks = torch.arange(tokens // BLOCK, device="cuda")
        target = blocks + max_blocks  # the receiver writes elsewhere than the sender read
        times = []
        for _ in range(repeats + 1):  # the first opens the channel: not timed
            torch.cuda.synchronize()
            start = time.perf_counter()
            for layers in [[layer] for layer in range(LAYERS)] if per_layer else [list(range(LAYERS))]:
                if role == "sender":
                    message = [t for layer in layers for t in storage.export_layer(layer, 0, KV_HEADS, blocks)]
                    transport.send(peer, [t.cpu() for t in message] if mode == "host-staged" else message, 30.0)
                else:
                    staging = [storage.staging(len(blocks)) for _ in layers]
                    flat = [t for message in staging for t in message]
                    landing = [t.cpu() for t in flat] if mode == "host-staged" else flat
                    transport.recv(peer, landing, 30.0)
                    for layer, received in zip(layers, landing, strict=True):
                        storage.import_layer(layer, target, [received.to("cuda")])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        num_bytes = tokens * storage.bytes_per_token
        figures[tokens] = {
            "bytes": num_bytes,
            "median_s": statistics.median(times[1:]),
            "gb_per_s": num_bytes / statistics.median(times[1:]) / 1e9,
        }
    transport.close()
    results.put((role, figures))


def run_mode(mode: str, per_layer: bool, tokens_list: list[int], repeats: int) -> dict:
    from kvtransfer.store import create_rendezvous_store

    store = create_rendezvous_store()
    results = _SPAWN.Queue()
    procs = [
        _SPAWN.Process(target=_worker, args=(role, mode, per_layer, store.port, tokens_list, repeats, results))
        for role in ("sender", "receiver")
    ]
    for proc in procs:
        proc.start()
    collected = dict(results.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(30)
    return collected["receiver"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_handoff.json")
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    tokens_list = [int(t) for t in args.tokens.split(",")]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    for mode, per_layer in (("cuda_ipc", True), ("cuda_ipc", False), ("host-staged", True)):
        name = f"{mode}/{'per-layer' if per_layer else 'one-message'}"
        result[name] = run_mode(mode, per_layer, tokens_list, args.repeats)
        for tokens, row in result[name].items():
            print(
                f"handoff {name:23s} {tokens:5d} tokens ({row['bytes'] / 2**20:.0f} MiB): "
                f"{row['median_s'] * 1e3:.2f} ms, {row['gb_per_s']:.1f} GB/s",
                flush=True,
            )
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
