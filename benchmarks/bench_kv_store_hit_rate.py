"""Prefix hit rate on the Mooncake conversation trace with worker pools below the working set: pools
alone, + host tier, + shared store; and right after a rolling restart of every prefill worker.

    scripts/in_sandbox.sh .venv/bin/python -m benchmarks.bench_kv_store_hit_rate --trace TRACE.jsonl
        [--requests 4000] [--warmup 1000] [--workers 4] [--pool-blocks 2048] [--host-blocks 8192]
        [--store-mb 48] [--restart-at 2500] [--restart-every 25] [--after-restart 500]
        [--json docs/perf/kv_store_hit_rate/cpu.json]

What is replayed: the block ids of the trace's first `requests` rows (one trace block = one 512-token
KV block; block ids are chained, so a key stands for its whole prefix), in arrival order, through the
real objects of each tier, with no model and no timing:
- each prefill worker's pool is the engine's real `BlockPool` (through the simulator's `PrefixPool`,
  sim/kv.py): a prompt's leading cached blocks are hits, its blocks are allocated evicting the least
  recently used cached ones, its full blocks registered, then released tail first as the engine does;
- routing is the router's real `cache_aware` policy over the real in-process prefix index, which the
  pools' real KV events feed; a worker's load is the uncached tokens routed to it in the current
  arrival bucket of the trace (its ~3 s buckets: what the others queued at the same moment);
- the host tier is the real `MemoryTier` of each worker, `host-blocks` records of RECORD_BYTES;
- the store is a real redis-server with `maxmemory` `store-mb` MB and `allkeys-lru`, read and written
  by the real `RedisBlockStore`; a worker reads a prompt's chain after its pool hits through the real
  `TieredStore` (host first, store hits copied into the host tier), as `StoreFetcher` does, and
  writes the blocks it computed to its tiers (fetched blocks are not written back), as `StoreWriter`
  does, here synchronously: a replay has no time for a write to lag.
Record payloads are RECORD_BYTES of filler (the tiers never look inside a record), so the store's
capacity in blocks is what `store-mb` holds at that size; the JSON reports it (DBSIZE at the end).

Hit rate = prompt tokens found in some tier / prompt tokens, over the rows after `warmup` (the engine's
rule: the last prompt token is always computed). The oracle is an infinite cache over the same rows.
Host-aware index: in the arms so named, each host tier publishes what enters and leaves it as KV events
of medium "host" into the same numbered stream (as a prefill worker's does), and `cache_aware` prices a
fetch from a worker's own host tier (policies/host_fetch_cost.py, at its prior bandwidth: a replay has
no time to measure, and a block's bytes are the demo model's, HOST_BLOCK_BYTES); the other arms run the
index as it was before host tiers were published (pool events only), for comparison in the same run.
Rolling restart: from row `restart-at`, one worker every `restart-every` rows restarts empty (a new
pool, an empty host tier, a new epoch in the index: the host tier is the worker's own); the figure is
the hit rate of the `after-restart` rows from the first restart, against the same rows without one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from common.kv_events import KVEventBatch
from engine.block_hash import BlockHash
from engine.block_pool import MEDIUM_HOST, BlockRemoved, BlockStored, KVCacheEvent
from kv_store.base import BlockStore
from kv_store.host_tier import MemoryTier
from kv_store.redis_store import RedisBlockStore
from kv_store.tiers import TieredStore
from loadtest.trace_rows import TraceRow, read_trace
from policies.admission import PrefillCostModel
from policies.host_fetch_cost import HostFetchCost
from policies.routing import CacheAwarePolicy, LoadBook, RouteQuery, WorkerLoad
from prefix_index.memory import InProcessPrefixIndex
from sim.drive import run_now
from sim.kv import PrefixPool
from sim.seq import block_hashes

TRACE_BLOCK_TOKENS = 512
RECORD_BYTES = 1024
HOST_BLOCK_BYTES = 24_576 * TRACE_BLOCK_TOKENS  # the demo model's KV of one block: what a host-tier fetch moves
# arm → (host tier, shared store, host-aware index)
ARMS = {
    "pools": (False, False, False),
    "pools+host": (True, False, False),
    "pools+host, host-aware index": (True, False, True),
    "pools+host+store": (True, True, False),
    "pools+host+store, host-aware index": (True, True, True),
}


class Worker:
    """One prefill worker of the replay: its pool (whose KV events it numbers) and its host tier."""

    def __init__(self, worker_id: str, epoch: int, pool_blocks: int, host: MemoryTier | None, publish_host: bool):
        self.worker_id, self.epoch, self.host = worker_id, epoch, host
        self.events: list[tuple[int, KVCacheEvent]] = []
        self.seq = 0
        self.pool = PrefixPool(pool_blocks, TRACE_BLOCK_TOKENS, on_event=self.on_event)
        if host is not None and publish_host:  # the replay's tier keys are the block hashes themselves
            host.on_change = self.on_host_change

    def on_host_change(self, stored_keys: list[bytes], evicted_keys: list[bytes]) -> None:
        if stored_keys:
            self.on_event(BlockStored(tuple(BlockHash(k) for k in stored_keys), None, (), medium=MEDIUM_HOST))
        if evicted_keys:
            self.on_event(BlockRemoved(tuple(BlockHash(k) for k in evicted_keys), medium=MEDIUM_HOST))

    def on_event(self, event: KVCacheEvent) -> None:
        self.seq += 1
        self.events.append((self.seq, event))


@dataclass
class Tally:
    prompt_tokens: int = 0
    pool_tokens: int = 0
    host_tokens: int = 0
    store_tokens: int = 0

    def add(self, prompt: int, pool: int, host: int, store: int) -> None:
        self.prompt_tokens += prompt
        self.pool_tokens += pool
        self.host_tokens += host
        self.store_tokens += store

    def report(self) -> dict:
        total = max(self.prompt_tokens, 1)
        hit = self.pool_tokens + self.host_tokens + self.store_tokens
        return {
            "hit_rate": round(hit / total, 4),
            "from_pool": round(self.pool_tokens / total, 4),
            "from_host": round(self.host_tokens / total, 4),
            "from_store": round(self.store_tokens / total, 4),
            "prompt_tokens": self.prompt_tokens,
        }


class Fleet:
    def __init__(self, args, use_host: bool, store: BlockStore | None, host_aware: bool = False):
        self.args, self.use_host, self.store, self.host_aware = args, use_host, store, host_aware
        self.index = InProcessPrefixIndex(lease_s=1e9, clock=lambda: 0.0)
        self.policy = CacheAwarePolicy(self.index)
        if host_aware:
            self.policy.locate_host_tier(HostFetchCost(HOST_BLOCK_BYTES, PrefillCostModel()))
        self.workers = [self._worker(f"p{i}", 1) for i in range(args.workers)]
        self.queued: dict[str, int] = {}
        self.bucket_s: float | None = None

    def _worker(self, worker_id: str, epoch: int) -> Worker:
        host = MemoryTier(self.args.host_blocks * RECORD_BYTES) if self.use_host else None
        return Worker(worker_id, epoch, self.args.pool_blocks, host, self.host_aware)

    def restart(self, i: int) -> None:
        old = self.workers[i]
        if old.host is not None:
            old.host.close()
        run_now(self.index.remove_worker(old.worker_id))
        self.workers[i] = self._worker(old.worker_id, old.epoch + 1)

    def serve(self, row: TraceRow) -> tuple[int, int, int]:
        """Routes and replays one row; (pool, host, store) hit tokens."""
        assert row.hash_ids is not None
        if row.arrival_s != self.bucket_s:  # a new arrival bucket: what was queued is computed by now
            self.bucket_s, self.queued = row.arrival_s, {}
        keys = block_hashes(row.hash_ids)
        query = RouteQuery(keys, row.input_length, TRACE_BLOCK_TOKENS, bytes(keys[0]) if keys else b"")
        loads = LoadBook(WorkerLoad(w.worker_id, 0, self.queued.get(w.worker_id, 0)) for w in self.workers)
        chosen = run_now(self.policy.choose(query, loads)).worker_id
        worker = next(w for w in self.workers if w.worker_id == chosen)
        pool_blocks, host_blocks, store_blocks = self._replay(worker, keys, row.input_length)
        hit_blocks = pool_blocks + host_blocks + store_blocks
        self.queued[chosen] = self.queued.get(chosen, 0) + max(row.input_length - hit_blocks * TRACE_BLOCK_TOKENS, 1)
        self._publish(worker)
        return tuple(n * TRACE_BLOCK_TOKENS for n in (pool_blocks, host_blocks, store_blocks))  # type: ignore[return-value]

    def _replay(self, worker: Worker, keys: tuple[BlockHash, ...], prompt_tokens: int) -> tuple[int, int, int]:
        pool = worker.pool
        hits = pool.match(keys, prompt_tokens)
        most = (prompt_tokens - 1) // TRACE_BLOCK_TOKENS  # the last token is always computed
        full = prompt_tokens // TRACE_BLOCK_TOKENS
        tiers = [t for t in (worker.host, self.store) if t is not None]
        wanted = [bytes(k) for k in keys[len(hits) : most]]
        host_blocks = store_blocks = 0
        if tiers and wanted:
            in_host = worker.host.contains_many(wanted) if worker.host is not None else [False] * len(wanted)
            run = len(TieredStore(tiers).fetch_chain(wanted))
            host_blocks = sum(in_host[:run])
            store_blocks = run - host_blocks
        fetched = host_blocks + store_blocks
        total = -(-prompt_tokens // TRACE_BLOCK_TOKENS)
        if not pool.can_take(hits, total):  # a prompt larger than the pool: computed, nothing kept
            return len(hits), 0, 0
        table = pool.take(hits, total)
        pool.mark(table, keys, len(hits), full)
        pool.release(table)
        computed = [(bytes(k), b"\0" * RECORD_BYTES) for k in keys[len(hits) + fetched : full]]
        for tier in tiers:
            tier.put_many(computed)
        return len(hits), host_blocks, store_blocks

    def _publish(self, worker: Worker) -> None:
        if worker.events:
            batch = KVEventBatch(worker.worker_id, worker.epoch, worker.seq, tuple(worker.events))
            run_now(self.index.apply(batch))
            worker.events.clear()


def _oracle(rows: list[TraceRow], warmup: int) -> float:
    seen: set[int] = set()
    hit = total = 0
    for n, row in enumerate(rows):
        assert row.hash_ids is not None
        run = 0
        for block_id in row.hash_ids[: (row.input_length - 1) // TRACE_BLOCK_TOKENS]:
            if block_id not in seen:
                break
            run += 1
        if n >= warmup:
            hit, total = hit + run * TRACE_BLOCK_TOKENS, total + row.input_length
        seen.update(row.hash_ids[: row.input_length // TRACE_BLOCK_TOKENS])
    return round(hit / total, 4)


@contextlib.contextmanager
def _redis_server(maxmemory_bytes: int):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="bench-kv-hit-")
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir]
    args += ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", *args], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_timeout=5)
        deadline_s = time.monotonic() + 10
        while True:
            with contextlib.suppress(redis.RedisError):
                client.ping()
                break
            if time.monotonic() > deadline_s:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0", client
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def replay(args, rows: list[TraceRow], arm: str, restart: bool, url: str | None) -> dict:
    store = RedisBlockStore(url, timeout_s=5.0) if url is not None else None
    use_host, _, host_aware = ARMS[arm]
    fleet = Fleet(args, use_host=use_host, store=store, host_aware=host_aware)
    steady, after = Tally(), Tally()
    restarts = {args.restart_at + i * args.restart_every: i for i in range(args.workers)} if restart else {}
    started_s = time.perf_counter()
    for n, row in enumerate(rows):
        if n in restarts:
            fleet.restart(restarts[n])
        pool, host, store_tokens = fleet.serve(row)
        if n >= args.warmup:
            steady.add(row.input_length, pool, host, store_tokens)
        if args.restart_at <= n < args.restart_at + args.after_restart:
            after.add(row.input_length, pool, host, store_tokens)
    result: dict = {"all_after_warmup": steady.report(), "after_restart_window": after.report()}
    result["replay_s"] = round(time.perf_counter() - started_s, 1)
    if store is not None:
        assert store.stats.errors == 0, "the store failed during the replay"
        store.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="the Mooncake conversation_trace.jsonl")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--pool-blocks", type=int, default=2048, help="each worker's pool, in 512-token blocks")
    parser.add_argument("--host-blocks", type=int, default=8192, help="each worker's host tier, in blocks")
    parser.add_argument("--store-mb", type=int, default=48, help="the store's maxmemory")
    parser.add_argument("--restart-at", type=int, default=2500)
    parser.add_argument("--restart-every", type=int, default=25)
    parser.add_argument("--after-restart", type=int, default=500)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    trace = read_trace(args.trace, "mooncake")
    rows = list(trace.rows[: args.requests])
    unique = len({h for row in rows for h in (row.hash_ids or ())})
    out: dict = {
        "benchmark": "kv_store_hit_rate",
        "machine": f"{platform.machine()}, {platform.system()}, CPU only (the replay runs no model)",
        "trace": Path(args.trace).name,
        "rows": len(rows),
        "warmup_rows": args.warmup,
        "unique_blocks": unique,
        "workers": args.workers,
        "pool_blocks_per_worker": args.pool_blocks,
        "fleet_pool_share_of_working_set": round(args.workers * args.pool_blocks / unique, 3),
        "host_blocks_per_worker": args.host_blocks,
        "store_maxmemory_bytes": args.store_mb << 20,
        "record_bytes": RECORD_BYTES,
        "block_tokens": TRACE_BLOCK_TOKENS,
        "restart": {"at_row": args.restart_at, "every_rows": args.restart_every, "window_rows": args.after_restart},
        "oracle_hit_rate": _oracle(rows, args.warmup),
        "arms": {},
    }
    for arm in ARMS:
        for restart in (False, True):
            if ARMS[arm][1]:
                with _redis_server(args.store_mb << 20) as (url, client):
                    result = replay(args, rows, arm, restart, url)
                    info = client.info("stats")
                    result["store_blocks_held_at_end"] = int(client.dbsize())
                    result["store_evicted_blocks"] = int(info.get("evicted_keys", 0))
            else:
                result = replay(args, rows, arm, restart, None)
            out["arms"].setdefault(arm, {})["rolling_restart" if restart else "steady"] = result
            print(arm, "restart" if restart else "steady", json.dumps(result), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "arms"}, indent=2))


if __name__ == "__main__":
    main()
