"""The Redis prefix index: workers publish into it, any number of routers look up from it.

Schema (P = `IndexNamespace.key_prefix()`, one per model / block size / hash spec):

* ``P:workers``          ZSET  worker_id → lease deadline (ms, Redis server clock): who is live.
* ``P:w:<worker>``       HASH  {epoch, seq}: the worker's cursor (epoch as a decimal string).
* ``P:b:<worker>:<epoch>`` SET of raw 16-byte block hashes the worker holds in that epoch (its pool).
* ``P:h:<worker>:<epoch>`` SET of those its host tier holds (absent while it publishes none).
* All of them carry the same deadline (PEXPIREAT), so a dead worker's keys are freed by Redis itself;
  its registry member is trimmed by the next write, and the registry key expires with its last member.
* Every operation is one Lua script (redis_scripts.py): atomic, and one round trip per call.

Why per-worker sets rather than a hash per block (block → {worker: epoch}): Redis 7.0 has no
per-field TTL, so per-block holder maps of a dead worker could only be freed by a reaper walking all
its blocks (in a script that blocks the server) — per-worker keys expire whole with no reaper. An
epoch bump or a snapshot is one UNLINK of one set. The price is a lookup cost of one SMISMEMBER per
live worker instead of one read per block; prefill pools are tens of workers, and SMISMEMBER of a
prompt's hashes is microseconds (see bench.py). The registry ZSET lets the lookup find live workers
without SCAN, and its scores make liveness exact to the millisecond independent of lazy expiry.

Failures: every call is bounded (connect, socket and pool-wait timeouts, plus an overall deadline).
Connection errors, timeouts and errors Redis answers with (OOM, LOADING, READONLY, BUSY, ...) all
become `PrefixIndexUnavailable`: to a caller they mean the same, "no answer now, fall back". A stale
pooled connection (e.g. after a Redis restart) is retried once at once, so the first call after a
restart does not fail needlessly. Deployments should not let Redis evict these keys early
(`maxmemory-policy noeviction` or `volatile-ttl`): an evicted set only loses hits until the next
snapshot, but nothing here expects it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from common.kv_events import KVEventBatch
from engine.block_hash import BLOCK_HASH_BYTES, BlockHash
from engine.block_pool import MEDIUM_HOST, BlockStored, IntegrityError
from prefix_index import redis_scripts
from prefix_index.base import (
    IndexNamespace,
    PrefixIndex,
    PrefixIndexUnavailable,
    PrefixMatch,
    check_batch,
    check_hashes,
    check_worker,
    sort_matches,
)
from prefix_index.redis_failures import is_unavailable

SNAPSHOT_CHUNK_HASHES = 4096  # hashes per script argument: 64 KiB, well below any client buffer


class RedisPrefixIndex(PrefixIndex):
    """Safe for concurrent coroutines on one event loop (a blocking pool of connections); every
    method makes one request to Redis (plus a one-time script load per script and server start).
    Entries written here live `lease_s` past the writer's last apply / heartbeat; readers need not
    agree on `lease_s`: the deadline the writer set is stored with the entries."""

    def __init__(
        self, url: str, namespace: IndexNamespace, lease_s: float, *, timeout_s: float = 1.0, max_connections: int = 32
    ):
        if lease_s <= 0 or timeout_s <= 0:
            raise ValueError(f"lease_s and timeout_s must be > 0, got {lease_s!r}, {timeout_s!r}")
        self.namespace = namespace
        self.lease_ms = math.ceil(lease_s * 1000)
        self.timeout_s = timeout_s
        self._prefix = namespace.key_prefix()
        self._registry = f"{self._prefix}:workers"  # declared to every script: it routes by this key's slot
        # Blocking pool: beyond max_connections callers wait (bounded) instead of failing at once.
        self._pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, (redis_errors.ConnectionError,)),
        )
        self._redis = aioredis.Redis(connection_pool=self._pool)
        self._scripts = {
            name: self._redis.register_script(getattr(redis_scripts, name))
            for name in ("APPLY", "HEARTBEAT", "REMOVE", "MATCH", "INTEGRITY", "COUNT")
        }

    async def apply(self, batch: KVEventBatch) -> None:
        check_batch(batch)
        await self._run(
            "APPLY", batch.worker_id, str(batch.epoch), self.lease_ms, batch.last_seq, *_encode_changes(batch)
        )

    async def heartbeat(self, worker_id: str, epoch: int) -> None:
        check_worker(worker_id, epoch)
        await self._run("HEARTBEAT", worker_id, str(epoch), self.lease_ms)

    async def match(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch]:
        check_hashes(block_hashes)
        if not block_hashes:
            return []
        flat = await self._run("MATCH", *block_hashes)
        triples = [(flat[i].decode(), int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)]
        return sort_matches({w: n for w, n, _ in triples}, {w: h for w, _, h in triples if h})

    async def remove_worker(self, worker_id: str) -> None:
        await self._run("REMOVE", worker_id)

    async def num_entries(self) -> int:
        return int(await self._run("COUNT"))

    async def cursor(self, worker_id: str) -> tuple[int, int] | None:
        epoch, seq = await self._bounded(self._redis.hmget(f"{self._prefix}:w:{worker_id}", "epoch", "seq"))
        return None if epoch is None else (int(epoch), int(seq))

    async def check_integrity(self) -> None:
        problems = await self._run("INTEGRITY")
        if problems:
            raise IntegrityError("; ".join(p.decode(errors="replace") for p in problems))

    async def close(self) -> None:
        await self._redis.aclose()
        await self._pool.aclose()

    async def _run(self, script: str, *args):
        return await self._bounded(self._scripts[script](keys=(self._registry,), args=(self._prefix, *args)))

    async def _bounded(self, call):
        # The socket timeouts bound each read; the overall deadline also covers pool waits and the
        # one reconnect retry, so no caller ever waits much longer than 2 * timeout_s.
        try:
            async with asyncio.timeout(2 * self.timeout_s):
                return await call
        except Exception as err:
            if not is_unavailable(err):
                raise
            raise PrefixIndexUnavailable(f"prefix index unreachable: {type(err).__name__}: {err}") from err


def _encode_changes(batch: KVEventBatch) -> list:
    """The script's tail arguments: a snapshot's pool and host-tier hashes (the number of pool chunks
    first), or the first seq and each event's op + hashes (op: '+' / '-' pool, '>' / '<' host tier)."""
    if batch.snapshot is not None:
        pool, host = _chunks(batch.snapshot), _chunks(batch.host_snapshot)
        return ["s", len(pool), *pool, *host]
    first_seq = batch.events[0][0] if batch.events else batch.last_seq + 1
    args: list = ["e", first_seq]
    for _, event in batch.events:
        stored = isinstance(event, BlockStored)
        op = (">" if stored else "<") if event.medium == MEDIUM_HOST else ("+" if stored else "-")
        args += [op, b"".join(event.block_hashes)]
    return args


def _chunks(hashes: Sequence[BlockHash]) -> list[bytes]:
    packed = b"".join(hashes)
    step = SNAPSHOT_CHUNK_HASHES * BLOCK_HASH_BYTES
    return [packed[i : i + step] for i in range(0, len(packed), step)]
