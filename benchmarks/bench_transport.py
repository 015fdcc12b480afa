"""KV transfer throughput: ``TorchDistTransport`` vs one raw torch.distributed send of the same bytes.

Run inside the sandbox (it starts a TCPStore, which binds every interface)::

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_transport

Two spawned processes move a sequence's gathered KV blocks, ~16 / 64 / 256 MiB in fp32 and bf16, as
one message of either one tensor [2 (K/V), layers, blocks, block_size, kv_heads, head_dim] or one
tensor per (K/V, layer). Each repetition times the transport's ``recv`` of the message and a raw
``ProcessGroupGloo.recv`` of one uint8 tensor of the same total bytes, interleaved so that noise
from other jobs hits both alike; the table shows GB/s as median / best repetition.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import queue
import statistics
import time
from typing import Any, NamedTuple

import torch

from kvtransfer.store import connect_store, create_rendezvous_store

_TIMEOUT_S = 60.0
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Case(NamedTuple):
    dtype_name: str
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    per_layer: bool  # one tensor per (K/V, layer) instead of one tensor for the whole message

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        return self.block_shape if self.per_layer else (2, self.num_layers, *self.block_shape)

    @property
    def num_tensors(self) -> int:
        return 2 * self.num_layers if self.per_layer else 1

    @property
    def num_bytes(self) -> int:
        elem_bytes = torch.empty(0, dtype=_DTYPES[self.dtype_name]).element_size()
        return 2 * self.num_layers * self.num_blocks * self.block_size * self.kv_heads * self.head_dim * elem_bytes


class Row(NamedTuple):
    case: Case
    transport_gb_s: float  # median over repetitions
    raw_gb_s: float
    transport_best_gb_s: float  # fastest repetition: least disturbed by other jobs on the machine
    raw_best_gb_s: float


def _cases(args: argparse.Namespace) -> list[Case]:
    cases = []
    for dtype_name in args.dtypes:
        elem_bytes = torch.empty(0, dtype=_DTYPES[dtype_name]).element_size()
        block_bytes = 2 * args.layers * args.block_size * args.kv_heads * args.head_dim * elem_bytes
        for size_mib in args.sizes_mib:
            num_blocks = max(1, (size_mib << 20) // block_bytes)
            for per_layer in (False, True):
                shape = (args.layers, num_blocks, args.block_size, args.kv_heads, args.head_dim)
                cases.append(Case(dtype_name, *shape, per_layer))
    return cases


def _payload(case: Case, fill: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The whole KV [2 * layers, *block_shape] and the message's tensors (views of it)."""
    kv = torch.empty((2 * case.num_layers, *case.block_shape), dtype=_DTYPES[case.dtype_name])
    if fill:  # a distinct value per (K/V, layer), so the receiver can check order and content cheaply
        for i in range(kv.shape[0]):
            kv[i].fill_(float(i % 200))
    return kv, list(kv.unbind(0)) if case.per_layer else [kv.view(case.tensor_shape)]


def _check(case: Case, kv: torch.Tensor) -> None:
    for i in range(kv.shape[0]):
        if not bool(kv[i].eq(float(i % 200)).all()):
            raise AssertionError(f"{case}: (K/V, layer) {i} arrived corrupted")


def _worker(role: str, host: str, port: int, cases: list[Case], reps: int, results: Any) -> None:
    from torch.distributed import PrefixStore, ProcessGroupGloo

    from kvtransfer.torch_dist import TorchDistTransport

    torch.set_num_threads(1)  # spinning OpenMP workers of two processes would starve gloo on 2 cores
    me, peer = ("bench-sender", "bench-receiver") if role == "send" else ("bench-receiver", "bench-sender")
    transport = TorchDistTransport(me, host, port, backend="gloo", connect_timeout_s=_TIMEOUT_S)
    raw = ProcessGroupGloo(
        PrefixStore("bench/raw", connect_store(host, port)),
        0 if role == "send" else 1,
        2,
        datetime.timedelta(seconds=_TIMEOUT_S),
    )
    rows = []
    for case in cases:
        kv, tensors = _payload(case, fill=role == "send")
        flat = torch.empty(case.num_bytes, dtype=torch.uint8)
        transport_s, raw_s = [], []
        # Small cases repeat more (same bytes per case): their medians are the noisiest otherwise.
        for _rep in range(min(4 * reps, reps * max(1, (256 << 20) // case.num_bytes)) + 1):  # rep 0 warms up
            transport_s.append(_timed(role, raw, lambda tensors=tensors: _move(transport, role, peer, tensors)))
            raw_s.append(_timed(role, raw, lambda flat=flat: _raw_move(raw, role, flat)))
        if role == "recv":
            _check(case, kv)
            gb = case.num_bytes / 1e9
            medians = (gb / statistics.median(transport_s[1:]), gb / statistics.median(raw_s[1:]))
            rows.append(Row(case, *medians, gb / min(transport_s[1:]), gb / min(raw_s[1:])))
    transport.close()
    if role == "recv":
        results.put(rows)


def _move(transport: Any, role: str, peer: str, tensors: list[torch.Tensor]) -> None:
    if role == "send":
        transport.send(peer, tensors, _TIMEOUT_S)
    else:
        transport.recv(peer, tensors, _TIMEOUT_S)


def _raw_move(raw: Any, role: str, flat: torch.Tensor) -> None:
    work = raw.send([flat], 1, 0) if role == "send" else raw.recv([flat], 0, 0)
    work.wait(datetime.timedelta(seconds=_TIMEOUT_S))


def _timed(role: str, raw: Any, move: Any) -> float:
    """Line both sides up with a 1-element message, then time ``move`` on this side."""
    token = torch.zeros(1)
    _raw_move(raw, role, token.view(torch.uint8))
    start_s = time.perf_counter()
    move()
    return time.perf_counter() - start_s


def _print_table(rows: list[Row]) -> None:
    """GB/s as median / best repetition; ratio = transport / raw of the medians (and of the bests)."""
    columns = ("dtype", "MiB", "tensors", "tensor shape", "transport GB/s", "raw GB/s", "ratio med", "best")
    widths = (6, 6, 9, 30, 16, 12, 11, 7)
    print("".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True)))
    for row in rows:
        case = row.case
        cells = (
            case.dtype_name,
            f"{case.num_bytes / 2**20:.0f}",
            case.num_tensors,
            str(list(case.tensor_shape)),
            f"{row.transport_gb_s:.2f} / {row.transport_best_gb_s:.2f}",
            f"{row.raw_gb_s:.2f} / {row.raw_best_gb_s:.2f}",
            f"{row.transport_gb_s / row.raw_gb_s:.2f}",
            f"{row.transport_best_gb_s / row.raw_best_gb_s:.2f}",
        )
        print("".join(f"{cell:>{width}}" for cell, width in zip(cells, widths, strict=True)))


def _await_rows(results: Any, procs: list[Any], budget_s: float) -> list[Row]:
    """The receiver's rows; fails fast if a worker died instead of waiting out the budget."""
    deadline_s = time.monotonic() + budget_s
    while time.monotonic() < deadline_s:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a benchmark worker died (exit codes {dead})") from None
    raise TimeoutError(f"no benchmark result within {budget_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(_DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=9, help="repetitions of the largest case (x4 for small)")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rendezvous = create_rendezvous_store()
    cases = _cases(args)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(role, rendezvous.host, rendezvous.port, cases, args.reps, results))
        for role in ("send", "recv")
    ]
    for proc in procs:
        proc.start()
    try:
        rows = _await_rows(results, procs, budget_s=300.0)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    _print_table(rows)


if __name__ == "__main__":
    main()
