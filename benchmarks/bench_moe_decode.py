"""One MoE layer's decode step on CPU: one rank vs two ranks with experts split (expert parallel) vs two
ranks with every expert's features split (TP-sharded experts).

`python -m benchmarks.bench_moe_decode [--batches 1 16 64] [--json PATH]` (inside scripts/in_sandbox.sh).
The layer is engine/models/moe.py's router and engine/layers/fused_moe.py's experts: hidden 1024, 16
experts of 512 features, top-2, fp32 (Qwen-MoE-like proportions, scaled to fit two cores). Each rank
runs one thread in its own process; the two ranks form a real gloo group (decode_worker/tp_group.py)
and the step ends with its all-reduce, as in a decode instance. Every rank sees every token of the
step (attention's output is replicated in a TP group), so dispatch costs nothing; the combine is the
all-reduce. Reported: tokens/s per batch size (batch / median step time over `--steps`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from decode_worker.tp_group import create_tp_group
from engine.config import MoEConfig
from engine.layers.fused_moe import FusedMoE
from engine.models.moe import Router
from engine.parallel import SINGLE_RANK, TensorParallelGroup
from kvtransfer.store import create_rendezvous_store

HIDDEN, EXPERTS, INTERMEDIATE, TOP_K = 1024, 16, 512, 2
MOE = MoEConfig(EXPERTS, TOP_K, INTERMEDIATE, "softmax", True)


def _layer(tp: TensorParallelGroup, expert_parallel: bool) -> tuple[Router, FusedMoE]:
    gen = torch.Generator().manual_seed(tp.rank)
    router = Router(MOE, HIDDEN, torch.float32)
    experts = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, torch.float32, tp, expert_parallel)
    for param in (router.weight, experts.w13_weight, experts.w2_weight):
        param.data.normal_(0.0, 0.02, generator=gen)
    return router, experts


@torch.inference_mode()
def _time_steps(tp: TensorParallelGroup, expert_parallel: bool, batches: list[int], steps: int) -> dict[int, float]:
    router, experts = _layer(tp, expert_parallel)
    tokens_per_s = {}
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)  # every rank holds the same tokens, as in a TP group
        x = torch.randn(batch, HIDDEN, generator=gen)
        times_s = []
        for _ in range(steps + 3):  # three warm-up steps
            started_s = time.perf_counter()
            weights, ids = router(x)
            experts(x, ids, weights)
            times_s.append(time.perf_counter() - started_s)
        tokens_per_s[batch] = batch / statistics.median(times_s[3:])
    return tokens_per_s


def _rank(instance: str, rank: int, port: int, expert_parallel: bool, batches: list[int], steps: int, out) -> None:
    torch.set_num_threads(1)
    tp = create_tp_group(instance, rank, 2, "127.0.0.1", port, 60.0)
    try:
        result = _time_steps(tp, expert_parallel, batches, steps)
    finally:
        tp.close()
    if rank == 0:
        out.put(result)


def _two_ranks(expert_parallel: bool, batches: list[int], steps: int) -> dict[int, float]:
    store = create_rendezvous_store()
    context = mp.get_context("spawn")
    out = context.Queue()
    instance = f"bench-moe-{'ep' if expert_parallel else 'tp'}"
    ranks = [
        context.Process(target=_rank, args=(instance, rank, store.port, expert_parallel, batches, steps, out))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    result = out.get(timeout=600)
    for process in ranks:
        process.join(60)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {
        "one rank": _time_steps(SINGLE_RANK, True, args.batches, args.steps),
        "ep=2": _two_ranks(True, args.batches, args.steps),
        "tp-sharded experts, 2 ranks": _two_ranks(False, args.batches, args.steps),
    }
    print(f"{'arm':>30}" + "".join(f"{f'batch {b} tok/s':>16}" for b in args.batches))
    for arm, row in results.items():
        print(f"{arm:>30}" + "".join(f"{row[b]:>16.0f}" for b in args.batches))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        layer = {"hidden": HIDDEN, "experts": EXPERTS, "intermediate": INTERMEDIATE, "top_k": TOP_K, "dtype": "float32"}
        args.json.write_text(json.dumps({"layer": layer, "tokens_per_s": results}, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
