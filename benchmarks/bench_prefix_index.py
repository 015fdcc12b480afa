"""Prefix-index lookup latency, in-process vs Redis: W workers x M cached blocks, K-block prompts.

    python -m benchmarks.bench_prefix_index [--workers 4 16] [--blocks-per-worker 50000]
                                         [--prompt-blocks 64] [--lookups 2000] [--redis-url URL]

Workload: a pool of documents (chains of K real block hashes); each worker caches a random prefix
(1..K blocks) of random documents until it holds M blocks, so workers share prefixes of different
lengths, as prefill workers behind a cache-aware router do. Lookups ask for a whole document: 80% a
cached one, 20% one nobody holds. Each lookup is awaited alone (latency, not throughput).
Without --redis-url a private redis-server is started (tests/redis_server.py: run from a checkout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time

from common.kv_events import KVEventBatch
from engine.block_hash import BlockHash, HashNamespace, hash_blocks
from prefix_index.base import IndexNamespace, PrefixIndex
from prefix_index.memory import InProcessPrefixIndex
from prefix_index.redis_index import RedisPrefixIndex

BLOCK_SIZE = 16
HASH_NS = HashNamespace("bench-model", BLOCK_SIZE)
MISS_FRACTION = 0.2


def make_documents(count: int, prompt_blocks: int, rng: random.Random) -> list[list[BlockHash]]:
    return [
        hash_blocks(HASH_NS, [rng.randrange(32000) for _ in range(prompt_blocks * BLOCK_SIZE)]) for _ in range(count)
    ]


def worker_caches(
    workers: int, blocks_per_worker: int, documents: list[list[BlockHash]], rng: random.Random
) -> dict[str, set[BlockHash]]:
    caches = {}
    for w in range(workers):
        cached: set[BlockHash] = set()
        while len(cached) < blocks_per_worker:
            doc = rng.choice(documents)
            cached.update(doc[: rng.randint(1, len(doc))])
        caches[f"prefill-{w}"] = cached
    return caches


async def measure(index: PrefixIndex, caches: dict[str, set[BlockHash]], queries: list[list[BlockHash]]) -> dict:
    start = time.perf_counter()
    for worker_id, cached in caches.items():
        await index.apply(KVEventBatch(worker_id, time.time_ns(), 1, (), tuple(cached)))
    load_s = time.perf_counter() - start
    for query in queries[:50]:  # warm-up: script load, connections, caches
        await index.match(query)
    latencies_us, matched = [], 0
    for query in queries:
        t0 = time.perf_counter_ns()
        result = await index.match(query)
        latencies_us.append((time.perf_counter_ns() - t0) / 1000)
        matched += result[0].num_blocks if result else 0
    for worker_id in caches:
        await index.remove_worker(worker_id)
    cuts = statistics.quantiles(latencies_us, n=100)
    return {"load_s": load_s, "p50_us": cuts[49], "p99_us": cuts[98], "mean_best_blocks": matched / len(queries)}


def print_table(rows: list[dict]) -> None:
    header = (
        "index",
        "workers",
        "blocks/worker",
        "prompt blocks",
        "lookups",
        "p50 us",
        "p99 us",
        "mean best",
        "load s",
    )
    print(" | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for r in rows:
        print(
            f"{r['index']} | {r['workers']} | {r['blocks']} | {r['prompt_blocks']} | {r['lookups']} | "
            f"{r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['mean_best_blocks']:.1f} | {r['load_s']:.2f}"
        )


async def run(args: argparse.Namespace, redis_url: str) -> list[dict]:
    rng = random.Random(0)
    documents = make_documents(max(64, 3 * args.blocks_per_worker // args.prompt_blocks), args.prompt_blocks, rng)
    misses = make_documents(64, args.prompt_blocks, rng)
    queries = [rng.choice(misses if rng.random() < MISS_FRACTION else documents) for _ in range(args.lookups)]
    namespace = IndexNamespace(HASH_NS.model_identity, BLOCK_SIZE)
    rows = []
    for workers in args.workers:
        caches = worker_caches(workers, args.blocks_per_worker, documents, rng)
        for name, index in (
            ("in-process", InProcessPrefixIndex(lease_s=600)),
            ("redis", RedisPrefixIndex(redis_url, namespace, lease_s=600, timeout_s=5.0)),
        ):
            try:
                stats = await measure(index, caches, queries)
            finally:
                await index.close()
            rows.append(
                {
                    "index": name,
                    "workers": workers,
                    "blocks": args.blocks_per_worker,
                    "prompt_blocks": args.prompt_blocks,
                    "lookups": args.lookups,
                    **stats,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--blocks-per-worker", type=int, default=50_000)
    parser.add_argument("--prompt-blocks", type=int, default=64)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--redis-url", default=None, help="an existing Redis (default: start a private one)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.redis_url
        if url is None:
            from tests.redis_server import RedisServer  # a source checkout's helper; not shipped

            url = stack.enter_context(RedisServer()).url
        print_table(asyncio.run(run(args, url)))


if __name__ == "__main__":
    main()
