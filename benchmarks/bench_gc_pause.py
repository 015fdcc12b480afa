"""How long a full garbage collection stalls a worker-shaped process, before and after freezing its
start-up heap (`engine/heap.py`, which every worker and `splitserve serve` call once they serve).

    .venv/bin/python -m benchmarks.bench_gc_pause [--repeats 5]

The process imports what a worker imports (torch, transformers, Ray, gRPC) and builds the demo
model's engine, then times `gc.collect()` (a full, generation-2 collection: it holds the GIL, so a
worker's engine thread and every other thread wait it out) as the median of `--repeats`, then freezes
and times it again. Prints both.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time


def full_collection_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import grpc  # noqa: F401  (imported for the heap it brings, as a worker has it)
    import ray  # noqa: F401

    from engine.config import EngineConfig
    from engine.demo_model import write_demo_model
    from engine.heap import freeze_startup_heap
    from engine.llm_engine import LLMEngine

    model_dir = tempfile.mkdtemp(prefix="splitserve-gc-")
    write_demo_model(model_dir, progress=False)
    engine = LLMEngine(EngineConfig(model_dir=model_dir, num_threads=1))
    tracked = len(gc.get_objects())
    before_ms = full_collection_ms(args.repeats)
    frozen = freeze_startup_heap()
    after_ms = full_collection_ms(args.repeats)
    print(f"tracked objects: {tracked}; full collection: {before_ms:.1f} ms")
    print(f"after freezing {frozen} objects: {after_ms * 1e3:.1f} us")
    del engine


if __name__ == "__main__":
    main()
