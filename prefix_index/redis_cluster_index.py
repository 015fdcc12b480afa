"""The prefix index on a Redis Cluster: block entries spread over every shard (`redis+cluster://` URLs).

`RedisPrefixIndex` keeps a namespace in one hash tag (its scripts touch many keys at once), so one
model's whole index sits on one shard however many there are. Here each block has a key of its own,
tagged by the block hash, so blocks spread evenly over the slots; nothing runs across slots.

Schema (N = the namespace digest; P = `splitserve:pic:v<KEY_SCHEMA_VERSION>:N`):

* ``P:{b:<hash hex>}``          HASH  worker → epoch: who holds the block (one key per block, any shard);
  a field "\0<worker>" (worker ids hold no NUL) says the worker's host tier holds it.
* ``P:{w:N:<worker>}:state``    HASH  {epoch, seq, deadline}: the worker's cursor and lease (shard clock).
* ``P:{w:N:<worker>}:blocks``   SET   the raw hashes the worker's pool holds in that epoch.
* ``P:{w:N:<worker>}:host``     SET   and those its host tier holds.
* ``P:{N}:live`` / ``P:{N}:epochs``  ZSET worker → lease deadline, HASH worker → epoch: the registry.

Apply: one script on the worker's shard checks epoch and cursor exactly as the standalone index does,
updates the worker's block set and cursor, and answers which events are new and which hashes a dropped
epoch (or a replaced snapshot) held; the client then writes the holder maps with plain HSET / HDEL,
pipelined per shard, and refreshes the registry (one script on its shard). A write that fails half way
removes the worker's cursor, so its publisher resends a snapshot, which rewrites its holder maps.

Lookup: the registry (live workers and their epochs) and the chain's holder maps, fetched together,
the maps pipelined per shard in growing chunks (a chain that nobody continues stops early); a holder
counts only at the epoch the registry has for it. Leases: a worker whose lease ended is left out of
lookups at once; its keys are reclaimed by the next writer that trims it from the registry (it reads
the worker's block set and clears its holder fields), so no reaper walks the index.

Failures: calls are bounded as in the standalone index, and errors become `PrefixIndexUnavailable`
(the client's errors, and those raised within redis-py on a connection it closed under a command:
prefix_index/redis_failures.py),
with one difference for lookups: a shard that does not answer ends the chain where its first block
is (the prefix before it still counts), and lookups skip that shard for `SHARD_DOWN_S` instead of
waiting on it again. A dead shard thus costs the hits of the blocks it held, never a request; the
registry's shard down makes lookups unavailable (the router falls back to `prefix_hash`).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Sequence

from redis import exceptions as redis_errors
from redis.asyncio.cluster import ClusterNode, RedisCluster

from common.kv_events import KVEventBatch
from common.redis_url import RedisTarget
from engine.block_hash import BLOCK_HASH_BYTES, BlockHash
from engine.block_pool import MEDIUM_HOST, BlockStored, IntegrityError
from prefix_index import redis_cluster_scripts as scripts
from prefix_index.base import (
    KEY_SCHEMA_VERSION,
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
from prefix_index.redis_index import SNAPSHOT_CHUNK_HASHES, _encode_changes

FIRST_CHUNK_BLOCKS = 16  # holder maps asked for in the first round of a lookup; each next round x4
SHARD_DOWN_S = 1.0  # after a shard fails a lookup, lookups skip it this long (its blocks count as missing)


class RedisClusterPrefixIndex(PrefixIndex):
    """Safe for concurrent coroutines on one event loop; the client keeps a pool per shard."""

    def __init__(
        self,
        target: RedisTarget,
        namespace: IndexNamespace,
        lease_s: float,
        *,
        timeout_s: float = 1.0,
        max_connections: int = 32,
    ):
        if not target.cluster:
            raise ValueError(f"redis_url: {target.url!r} names one server, not a cluster")
        if lease_s <= 0 or timeout_s <= 0:
            raise ValueError(f"lease_s and timeout_s must be > 0, got {lease_s!r}, {timeout_s!r}")
        self.namespace = namespace
        self.lease_ms = math.ceil(lease_s * 1000)
        self.timeout_s = timeout_s
        raw = "\0".join((namespace.model_identity, str(namespace.block_size), namespace.hash_spec)).encode()
        digest = hashlib.blake2b(raw, digest_size=10).hexdigest()
        self._digest = digest
        self._prefix = f"splitserve:pic:v{KEY_SCHEMA_VERSION}:{digest}"
        self._registry = (f"{self._prefix}:{{{digest}}}:live", f"{self._prefix}:{{{digest}}}:epochs")
        self._redis = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.seeds],
            require_full_coverage=False,  # the live shards keep answering for their slots
            max_connections=max_connections,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            cluster_error_retry_attempts=1,
            ssl=target.tls,
        )
        # The cluster client fails a call beyond `max_connections` to one shard instead of waiting; a
        # call holds at most two connections to a shard at once (the registry read beside its blocks).
        self._calls = asyncio.Semaphore(max(max_connections // 2, 1))
        self._down_until_s: dict[str, float] = {}  # shard (host:port) → skipped until (monotonic)
        self._scripts = {
            name: self._redis.register_script(getattr(scripts, name))
            for name in (
                "WORKER_APPLY",
                "WORKER_SUSPECT",
                "WORKER_HEARTBEAT",
                "WORKER_FORGET",
                "WORKER_CURSOR",
                "REGISTRY_TOUCH",
                "REGISTRY_REMOVE",
                "REGISTRY_LIVE",
            )
        }

    # ---- keys -------------------------------------------------------------------------------------
    def _block_key(self, block_hash: bytes) -> str:
        return f"{self._prefix}:{{b:{block_hash.hex()}}}"

    def _worker_keys(self, worker_id: str) -> tuple[str, str, str]:
        """(state, pool blocks, host-tier blocks)."""
        tag = f"{self._prefix}:{{w:{self._digest}:{worker_id}}}"
        return f"{tag}:state", f"{tag}:blocks", f"{tag}:host"

    # ---- writes -----------------------------------------------------------------------------------
    async def apply(self, batch: KVEventBatch) -> None:
        check_batch(batch)
        await self._bounded(self._apply(batch))

    async def _apply(self, batch: KVEventBatch) -> None:
        worker, epoch = batch.worker_id, str(batch.epoch)
        keys = self._worker_keys(worker)
        reply = await self._scripts["WORKER_APPLY"](
            keys=keys, args=(epoch, self.lease_ms, batch.last_seq, *_encode_changes(batch))
        )
        status, base, dropped = reply[0].decode(), int(reply[1]), reply[2:]
        try:
            pipe = self._redis.pipeline(transaction=False)
            host_field = _host_field(worker)
            for block_hash in dropped:
                pipe.hdel(self._block_key(block_hash), worker, host_field)
            if status == "ok":
                if batch.snapshot is not None:
                    for field, hashes in ((worker, batch.snapshot), (host_field, batch.host_snapshot)):
                        for block_hash in hashes:
                            pipe.hset(self._block_key(block_hash), field, epoch)
                else:
                    for seq, event in batch.events:
                        if seq <= base:
                            continue
                        field = host_field if event.medium == MEDIUM_HOST else worker
                        for block_hash in event.block_hashes:
                            if isinstance(event, BlockStored):
                                pipe.hset(self._block_key(block_hash), field, epoch)
                            else:
                                pipe.hdel(self._block_key(block_hash), field)
            if len(pipe):
                await pipe.execute()
        except Exception as err:
            if not is_unavailable(err):
                raise
            if status == "ok":  # the holder maps may miss part of this batch: ask for a snapshot
                await self._scripts["WORKER_SUSPECT"](keys=keys[:1], args=())
            raise
        if status == "ok":
            expired = await self._scripts["REGISTRY_TOUCH"](keys=self._registry, args=(worker, epoch, self.lease_ms))
            for gone in expired:
                await self._reap(gone.decode(), only_if_expired=True)

    async def heartbeat(self, worker_id: str, epoch: int) -> None:
        check_worker(worker_id, epoch)
        await self._bounded(self._heartbeat(worker_id, str(epoch)))

    async def _heartbeat(self, worker_id: str, epoch: str) -> None:
        reply = await self._scripts["WORKER_HEARTBEAT"](keys=self._worker_keys(worker_id), args=(epoch, self.lease_ms))
        status = reply[0].decode()
        if status == "ok":
            expired = await self._scripts["REGISTRY_TOUCH"](keys=self._registry, args=(worker_id, epoch, self.lease_ms))
            for gone in expired:
                await self._reap(gone.decode(), only_if_expired=True)
        elif status == "restarted":
            await self._clear(worker_id, reply[1:])
            await self._scripts["REGISTRY_REMOVE"](keys=self._registry, args=(worker_id,))

    async def remove_worker(self, worker_id: str) -> None:
        await self._bounded(self._reap(worker_id, only_if_expired=False))

    async def _reap(self, worker_id: str, *, only_if_expired: bool) -> None:
        held = await self._scripts["WORKER_FORGET"](
            keys=self._worker_keys(worker_id), args=("1" if only_if_expired else "0",)
        )
        await self._clear(worker_id, held)
        if not only_if_expired:
            await self._scripts["REGISTRY_REMOVE"](keys=self._registry, args=(worker_id,))

    async def _clear(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        for i in range(0, len(hashes), SNAPSHOT_CHUNK_HASHES):
            pipe = self._redis.pipeline(transaction=False)
            for block_hash in hashes[i : i + SNAPSHOT_CHUNK_HASHES]:
                pipe.hdel(self._block_key(block_hash), worker_id, _host_field(worker_id))
            await pipe.execute()

    # ---- reads ------------------------------------------------------------------------------------
    async def match(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch]:
        check_hashes(block_hashes)
        if not block_hashes:
            return []
        return await self._bounded(self._match(block_hashes))

    async def _match(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch]:
        live_task = asyncio.ensure_future(self._live())
        # (worker, epoch) → leading blocks in its pool / in its pool or host tier, at that epoch
        pool_counts: dict[tuple[bytes, bytes], int] = {}
        reach_counts: dict[tuple[bytes, bytes], int] = {}
        pool_open: dict[bytes, bytes] | None = None  # workers whose pool holds every block so far → epoch
        reach_open: dict[bytes, bytes] = {}  # those whose pool or host tier does
        start, size = 0, FIRST_CHUNK_BLOCKS
        try:
            while start < len(block_hashes) and (pool_open is None or reach_open):
                chunk = block_hashes[start : start + size]
                for offset, holders in enumerate(await self._holder_maps(chunk)):
                    if holders is None:  # its shard is down: the chain is known only up to here
                        holders = {}
                    if pool_open is None:
                        pool_open = {w: e for w, e in holders.items() if not w.startswith(b"\0")}
                        reach_open = {w[1:]: e for w, e in holders.items() if w.startswith(b"\0")} | pool_open
                        continue
                    position = start + offset
                    for worker, epoch in list(pool_open.items()):
                        if holders.get(worker) != epoch:
                            del pool_open[worker]
                            pool_counts[worker, epoch] = position
                    for worker, epoch in list(reach_open.items()):
                        if holders.get(worker) != epoch and holders.get(b"\0" + worker) != epoch:
                            del reach_open[worker]
                            reach_counts[worker, epoch] = position
                    if not reach_open:
                        break
                start, size = start + len(chunk), size * 4
            for worker, epoch in (pool_open or {}).items():
                pool_counts[worker, epoch] = len(block_hashes)
            for worker, epoch in reach_open.items():
                reach_counts[worker, epoch] = len(block_hashes)
            live = await live_task
        finally:
            # Left to finish, not cancelled: a command cancelled mid-reply leaves its pooled connection
            # broken for the next caller. Its outcome is read so that a failure is not reported unread.
            live_task.add_done_callback(_read_outcome)
        # A holder counts only at the epoch the registry has for it: older epochs' fields await clearing.
        counts = {w.decode(): n for (w, e), n in pool_counts.items() if live.get(w.decode()) == e}
        host = {
            w.decode(): n - pool_counts.get((w, e), 0)
            for (w, e), n in reach_counts.items()
            if live.get(w.decode()) == e and n > pool_counts.get((w, e), 0)
        }
        return sort_matches(counts, host)

    async def _holder_maps(self, chunk: Sequence[BlockHash]) -> list[dict | None]:
        """Each block's holder map, None for blocks on a shard that did not answer (or failed within
        the last SHARD_DOWN_S: a dead shard costs its blocks' hits at once, not a timeout per lookup)."""
        await self._redis.initialize()  # the slot map (a no-op once loaded)
        keys = [self._block_key(h) for h in chunk]
        by_node: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            try:
                node = self._redis.get_node_from_key(key)
            except redis_errors.SlotNotCoveredError:  # its shard left the cluster's view: a miss
                node = None
            by_node.setdefault("" if node is None else node.name, []).append(i)
        now_s = time.monotonic()
        asked = [name for name in by_node if name and self._down_until_s.get(name, 0.0) <= now_s]

        async def fetch(name: str) -> list:
            pipe = self._redis.pipeline(transaction=False)
            for i in by_node[name]:
                pipe.hgetall(keys[i])
            return await pipe.execute()

        results: list[dict | None] = [None] * len(keys)
        answers = await asyncio.gather(*(fetch(name) for name in asked), return_exceptions=True)
        for name, answer in zip(asked, answers, strict=True):
            if isinstance(answer, BaseException):
                if not is_unavailable(answer):
                    raise answer
                self._down_until_s[name] = time.monotonic() + SHARD_DOWN_S
                continue
            for i, holders in zip(by_node[name], answer, strict=True):
                results[i] = holders
        return results

    async def _live(self) -> dict[str, bytes]:
        flat = await self._scripts["REGISTRY_LIVE"](keys=self._registry, args=())
        return {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}

    async def num_entries(self) -> int:
        return await self._bounded(self._num_entries())

    async def _num_entries(self) -> int:
        live = await self._live()
        if not live:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for worker in live:
            pipe.scard(self._worker_keys(worker)[1])
            pipe.scard(self._worker_keys(worker)[2])
        return sum(await pipe.execute())

    async def cursor(self, worker_id: str) -> tuple[int, int] | None:
        reply = await self._bounded(self._scripts["WORKER_CURSOR"](keys=self._worker_keys(worker_id)[:1], args=()))
        return None if reply is None else (int(reply[0]), int(reply[1]))

    async def check_integrity(self) -> None:
        problems = await self._bounded(self._problems(), budget_s=30.0)
        if problems:
            raise IntegrityError("; ".join(problems[:10]))

    async def _problems(self) -> list[str]:
        """Every holder field backed by its worker's block set at its epoch, and the reverse (tests)."""
        problems: list[str] = []
        epochs = {_text(w): e for w, e in (await self._redis.hgetall(self._registry[1])).items()}
        backed: set[tuple[bytes, str]] = set()  # (hash, holder field): a worker, or a host-tier field
        for worker, epoch in epochs.items():
            state_key, blocks_key, host_key = self._worker_keys(worker)
            state = await self._redis.hgetall(state_key)
            if state.get(b"epoch") != epoch:
                problems.append(f"{worker}: registry epoch {epoch!r}, state {state.get(b'epoch')!r}")
                continue
            for key, field in ((blocks_key, worker), (host_key, _host_field(worker))):
                for member in await self._redis.smembers(key):
                    block_hash = bytes(member, "latin-1") if isinstance(member, str) else member
                    if len(block_hash) != BLOCK_HASH_BYTES:
                        problems.append(f"{worker} holds a malformed hash")
                        continue
                    backed.add((block_hash, field))
                    if await self._redis.hget(self._block_key(block_hash), field) != epoch:
                        problems.append(f"{field!r} holds {block_hash.hex()} but its holder map disagrees")
        pattern = f"{self._prefix}:{{b:*"
        async for key in self._redis.scan_iter(match=pattern, count=1000):
            block_hash = bytes.fromhex(_text(key).rsplit("{b:", 1)[1].rstrip("}"))
            holders = [_text(worker) for worker in await self._redis.hkeys(key)]
            problems.extend(
                f"{_text(key)} lists {w!r}, which does not hold it" for w in holders if (block_hash, w) not in backed
            )
        return problems

    async def close(self) -> None:
        await self._redis.aclose()

    async def _bounded(self, call, budget_s: float | None = None):
        # Socket timeouts bound each read; the overall deadline covers retries, redirects and pool waits.
        try:
            async with asyncio.timeout(budget_s or 4 * self.timeout_s):
                async with self._calls:
                    return await call
        except Exception as err:
            if not is_unavailable(err):
                raise
            raise PrefixIndexUnavailable(f"prefix index unreachable: {type(err).__name__}: {err}") from err
        finally:
            call.close()  # a call never started (its turn did not come in time) is discarded quietly


def _host_field(worker_id: str) -> str:
    """The holder-map field saying the worker's host tier holds the block."""
    return "\0" + worker_id


def _text(value: bytes | str) -> str:
    """A key or field as text (the client answers bytes; its stubs say either)."""
    return value.decode() if isinstance(value, bytes) else value


def _read_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()
