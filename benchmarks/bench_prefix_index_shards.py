"""Prefix-index throughput on a Redis Cluster of 1 vs 3 shards: lookups and event applications per second.

    python -m benchmarks.bench_prefix_index_shards [--shards 1 3] [--clients 4] [--seconds 10]
                                                   [--json docs/perf/prefix_index_shards/cpu.json]

For each shard count a private cluster is started (tests/redis_cluster.py: run from a checkout) and
`--clients` processes drive it, each an event loop with 32 calls in flight through its own
`RedisClusterPrefixIndex`: first as publishers (each applies batches of 8 events of 4 new blocks to
its own worker, as a prefill worker's publisher does), then as routers (each looks up 32-block prompts,
80% of them held by some worker). Totals over all clients, per second of the run; calls the index
failed are counted apart (a publisher whose apply failed starts over from a snapshot).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import platform
import random
import subprocess
import tempfile
import time
from pathlib import Path

from common.kv_events import KVEventBatch
from engine.block_hash import BlockHash, HashNamespace, hash_blocks
from engine.block_pool import BlockStored
from prefix_index import IndexNamespace, make_redis_index

BLOCK_SIZE = 16
PROMPT_BLOCKS = 32
IN_FLIGHT = 32
HASH_NS = HashNamespace("bench-shards", BLOCK_SIZE)
NAMESPACE = IndexNamespace(HASH_NS.model_identity, BLOCK_SIZE)


def documents(seed: int, count: int) -> list[list[BlockHash]]:
    rng = random.Random(seed)
    return [
        hash_blocks(HASH_NS, [rng.randrange(32000) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE)]) for _ in range(count)
    ]


async def publish(url: str, client: int, seconds: float) -> tuple[int, int]:
    """Event batches applied in `seconds` by IN_FLIGHT publishers of this client (one worker each)."""
    index = make_redis_index(url, NAMESPACE, lease_s=600, timeout_s=5.0)
    rng = random.Random(client)
    deadline = time.monotonic() + seconds
    applied, errors = 0, [0]

    async def worker(n: int) -> None:
        nonlocal applied
        worker_id, seq = f"c{client}-w{n}", 0
        while time.monotonic() < deadline:
            events = []
            for _ in range(8):
                seq += 1
                blocks = tuple(BlockHash(rng.randbytes(16)) for _ in range(4))
                events.append((seq, BlockStored(blocks, None, ())))
            try:
                await index.apply(KVEventBatch(worker_id, 1, seq, tuple(events)))
            except Exception:  # noqa: BLE001 - counted: a failed apply is a result here, not a crash
                errors[0] += 1
                seq = 0  # its cursor is unknown now: start over from a snapshot of nothing
                await _quietly(index.apply(KVEventBatch(worker_id, 1, 0, (), ())))
                continue
            applied += 1

    await asyncio.gather(*(worker(n) for n in range(IN_FLIGHT)))
    await index.close()
    return applied, errors[0]


async def lookup(url: str, client: int, seconds: float, docs: list[list[BlockHash]]) -> tuple[int, int]:
    index = make_redis_index(url, NAMESPACE, lease_s=600, timeout_s=5.0)
    rng = random.Random(1000 + client)
    misses = documents(5000 + client, 16)
    deadline = time.monotonic() + seconds
    done, errors = 0, 0

    async def router() -> None:
        nonlocal done, errors
        while time.monotonic() < deadline:
            try:
                await index.match(rng.choice(misses) if rng.random() < 0.2 else rng.choice(docs))
            except Exception:  # noqa: BLE001 - counted: a failed lookup is a result here, not a crash
                errors += 1
                continue
            done += 1

    await asyncio.gather(*(router() for _ in range(IN_FLIGHT)))
    await index.close()
    return done, errors


async def _quietly(call) -> None:
    with contextlib.suppress(Exception):
        await call


def _client(args: tuple) -> tuple[int, int]:
    try:
        return _run_client(args)
    except Exception as err:  # noqa: BLE001 - re-raised as what the pool can send back (it pickles)
        raise RuntimeError(f"{type(err).__name__}: {err}") from None


def _run_client(args: tuple) -> tuple[int, int]:
    kind, url, client, seconds = args
    if kind == "publish":
        return asyncio.run(publish(url, client, seconds))
    return asyncio.run(lookup(url, client, seconds, documents(0, 256)))


async def load_documents(url: str) -> None:
    """256 documents, each held whole by one of 16 workers (what lookups find)."""
    index = make_redis_index(url, NAMESPACE, lease_s=600, timeout_s=5.0)
    docs = documents(0, 256)
    for w in range(16):
        held = tuple(h for d in docs[w::16] for h in d)
        await index.apply(KVEventBatch(f"holder-{w}", 1, 1, (), held))
    await index.close()


def measure(url: str, clients: int, seconds: float) -> dict:
    asyncio.run(load_documents(url))
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        published = pool.map(_client, [("publish", url, c, seconds) for c in range(clients)])
        looked_up = pool.map(_client, [("lookup", url, c, seconds) for c in range(clients)])
    applied = sum(n for n, _ in published)
    return {
        "event_batches_per_s": round(applied / seconds),
        "events_per_s": round(8 * applied / seconds),
        "lookups_per_s": round(sum(n for n, _ in looked_up) / seconds),
        "failed_applies": sum(e for _, e in published),
        "failed_lookups": sum(e for _, e in looked_up),
    }


def start_cluster(stack: contextlib.ExitStack, shards: int) -> str:
    """A private cluster's URL. `redis-cli --cluster create` wants 3 masters at least: one shard is a
    single cluster-enabled node given every slot."""
    from tests.redis_cluster import REDIS_CLI, ClusterNode, RedisClusterNodes  # a checkout's helpers

    if shards >= 3:
        return stack.enter_context(RedisClusterNodes(shards)).url
    if shards != 1:
        raise SystemExit("--shards: 1, or 3 and more")
    workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="redis-cluster-"))
    node = ClusterNode(workdir=workdir)
    stack.enter_context(node)
    subprocess.run(
        [REDIS_CLI, "-p", str(node.port), "cluster", "addslotsrange", "0", "16383"],
        check=True,
        capture_output=True,
        timeout=10,
    )
    deadline = time.monotonic() + 30
    while (
        "cluster_state:ok"
        not in subprocess.run(
            [REDIS_CLI, "-p", str(node.port), "cluster", "info"], capture_output=True, text=True, timeout=10
        ).stdout
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("a one-node cluster did not reach state ok in 30 s")
        time.sleep(0.05)
    return f"redis+cluster://127.0.0.1:{node.port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for shards in args.shards:
        with contextlib.ExitStack() as stack:
            url = start_cluster(stack, shards)
            row = {"shards": shards, "clients": args.clients, **measure(url, args.clients, args.seconds)}
        rows.append(row)
        print(json.dumps(row))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"machine": platform.processor() or platform.machine(), "args": {**vars(args), "json": str(args.json)}}
        args.json.write_text(json.dumps({**report, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
