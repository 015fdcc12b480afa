"""The PrefixIndex contract (prefix_index/base.py), run against every implementation.

Each scenario runs in its own event loop with a fresh index; `check_integrity()` runs after it.
Lease expiry uses an injected clock in-process and real (short) waits against Redis (one server, and a
3-shard Redis Cluster shared by the module, each test in a namespace of its own).
"""
from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable

import pytest

from common.kv_events import KVEventBatch, KVEventBuffer
from engine.block_hash import HashNamespace, hash_blocks
from engine.block_pool import BlockRemoved, BlockStored
from prefix_index import (
    IndexNamespace,
    InProcessPrefixIndex,
    PrefixIndex,
    PrefixMatch,
    RedisPrefixIndex,
    make_redis_index,
)
from prefix_index.worker_slots import WorkerSlots

NS = HashNamespace("contract-model", 4)
E1 = 1_700_000_000_000_000_001  # realistic nanosecond epochs: beyond a double's exact integers
E2 = 1_700_000_000_000_000_002


def chain(num_blocks: int, doc: int = 0) -> list[bytes]:
    return hash_blocks(NS, [doc * 100_000 + i for i in range(4 * num_blocks)])


A, B = chain(8), chain(8, doc=1)


def events(worker: str, epoch: int, first_seq: int, *evs) -> KVEventBatch:
    numbered = tuple(enumerate(evs, first_seq))
    return KVEventBatch(worker, epoch, first_seq + len(evs) - 1, numbered)


def snapshot(worker: str, epoch: int, last_seq: int, hashes) -> KVEventBatch:
    return KVEventBatch(worker, epoch, last_seq, (), tuple(hashes))


def stored(*hashes) -> BlockStored:
    return BlockStored(tuple(hashes), None, ())


def removed(*hashes) -> BlockRemoved:
    return BlockRemoved(tuple(hashes))


class FakeClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Backend:
    """Makes indexes of one implementation and lets lease time pass for it."""

    def __init__(self, make: Callable[[float], PrefixIndex], elapse: Callable[[float], Awaitable[None]]):
        self.make, self.elapse = make, elapse

    def run(self, scenario, lease_s: float = 30.0) -> None:
        async def main():
            index = self.make(lease_s)
            try:
                await scenario(index, self)
                await index.check_integrity()
            finally:
                await index.close()
        asyncio.run(asyncio.wait_for(main(), 20))


_namespaces = itertools.count()


@pytest.fixture(params=["in_process", "in_process_shared_slots", "redis", "redis_cluster"])
def backend(request) -> Backend:
    if request.param.startswith("in_process"):
        clock = FakeClock()

        async def advance(seconds: float) -> None:
            clock.now_s += seconds
        if request.param == "in_process_shared_slots":  # slots a LoadBook shares: never freed by the index
            return Backend(lambda lease_s: InProcessPrefixIndex(lease_s, clock, WorkerSlots()), advance)
        return Backend(lambda lease_s: InProcessPrefixIndex(lease_s, clock), advance)
    if request.param == "redis_cluster":  # one cluster per module: each test its own namespace
        cluster = request.getfixturevalue("redis_cluster")
        namespace = IndexNamespace(f"{NS.model_identity}-{next(_namespaces)}", NS.block_size)
        return Backend(lambda lease_s: make_redis_index(cluster.url, namespace, lease_s), asyncio.sleep)
    server = request.getfixturevalue("redis_server")
    namespace = IndexNamespace(NS.model_identity, NS.block_size)
    return Backend(lambda lease_s: RedisPrefixIndex(server.url, namespace, lease_s), asyncio.sleep)


def test_match_counts_each_workers_leading_blocks(backend):
    async def scenario(index, _):
        await index.apply(events("w-a", E1, 1, stored(*A[:6])))
        await index.apply(events("w-b", E1, 1, *(stored(h) for h in A[:3])))
        await index.apply(events("w-c", E1, 1, stored(*B)))
        assert await index.match(A) == [PrefixMatch("w-a", 6), PrefixMatch("w-b", 3)]
        assert await index.match(A[:2]) == [PrefixMatch("w-a", 2), PrefixMatch("w-b", 2)]  # ties by id
        assert await index.match(B[:5]) == [PrefixMatch("w-c", 5)]
        assert await index.match(chain(4, doc=2)) == []
        assert await index.match([]) == []
        assert await index.num_entries() == 6 + 3 + len(B)
    backend.run(scenario)


def test_prefix_stops_at_the_first_missing_block(backend):
    async def scenario(index, _):
        await index.apply(events("w1", E1, 1, stored(A[0], A[1], A[3], A[4])))
        await index.apply(events("w2", E1, 1, stored(*A[1:])))  # everything but block 0
        assert await index.match(A) == [PrefixMatch("w1", 2)]
        await index.apply(events("w1", E1, 2, removed(A[0])))
        assert await index.match(A) == []
    backend.run(scenario)


def test_reapplying_a_batch_or_an_older_one_changes_nothing(backend):
    async def scenario(index, _):
        full = events("w", E1, 1, *(stored(h) for h in A[:4]), removed(A[3]))
        await index.apply(full)
        await index.apply(full)
        await index.apply(events("w", E1, 1, *(stored(h) for h in A[:4])))  # older: would revive A[3]
        assert await index.match(A) == [PrefixMatch("w", 3)]
        assert await index.cursor("w") == (E1, 5)
        await index.apply(events("w", E1, 4, stored(A[3]), removed(A[3]), stored(A[3]), stored(A[4])))
        assert await index.match(A) == [PrefixMatch("w", 5)]  # overlap skipped, the rest applied
        assert await index.cursor("w") == (E1, 7)
    backend.run(scenario)


def test_a_batch_leaving_a_gap_is_ignored_and_the_cursor_says_where_to_resume(backend):
    async def scenario(index, _):
        await index.apply(events("w", E1, 1, stored(A[0]), stored(A[1])))
        await index.apply(events("w", E1, 5, stored(A[2])))
        assert await index.cursor("w") == (E1, 2)
        assert await index.match(A) == [PrefixMatch("w", 2)]
        await index.apply(events("new", E1, 3, stored(*A)))  # unknown worker: only seq 1 or a snapshot
        assert await index.cursor("new") is None
        await index.apply(snapshot("new", E1, 3, A))
        assert await index.match(A) == [PrefixMatch("new", 8), PrefixMatch("w", 2)]
    backend.run(scenario)


def test_a_newer_epoch_drops_everything_of_the_older_one(backend):
    async def scenario(index, _):
        await index.apply(events("w", 9, 1, stored(*A[:5])))
        await index.apply(events("w", 10, 1, stored(A[0])))  # 10 > 9 although "10" < "9" as text
        assert await index.match(A) == [PrefixMatch("w", 1)]
        assert await index.cursor("w") == (10, 1)
        await index.apply(events("w", 9, 1, stored(*A[:5]), stored(B[0])))  # the old epoch, late
        await index.heartbeat("w", 9)
        assert await index.match(A) == [PrefixMatch("w", 1)]
        assert await index.cursor("w") == (10, 1)
        await index.apply(events("w", E2, 1, stored(*B[:2])))
        assert (await index.match(A), await index.match(B)) == ([], [PrefixMatch("w", 2)])
    backend.run(scenario)


def test_a_snapshot_replaces_the_workers_entries(backend):
    async def scenario(index, _):
        await index.apply(events("w", E1, 1, stored(*A[:5])))
        await index.apply(snapshot("w", E1, 9, [A[0], A[1], B[0]]))
        assert (await index.match(A), await index.match(B)) == ([PrefixMatch("w", 2)], [PrefixMatch("w", 1)])
        await index.apply(snapshot("w", E1, 3, A))  # older than the cursor
        assert await index.match(A) == [PrefixMatch("w", 2)]
        await index.apply(snapshot("w", E1, 9, []))
        assert await index.match(A) == [] and await index.cursor("w") == (E1, 9)
    backend.run(scenario)


def test_heartbeats_refresh_only_a_known_epoch(backend):
    async def scenario(index, _):
        await index.heartbeat("ghost", E1)
        assert await index.cursor("ghost") is None
        await index.apply(events("w", E1, 1, stored(*A[:2])))
        await index.heartbeat("w", E1)
        assert await index.match(A) == [PrefixMatch("w", 2)]
        await index.heartbeat("w", E2)  # it restarted: its old blocks are gone
        assert await index.match(A) == [] and await index.cursor("w") is None
    backend.run(scenario)


def test_remove_worker(backend):
    async def scenario(index, _):
        await index.apply(events("w1", E1, 1, stored(*A[:3])))
        await index.apply(events("w2", E1, 1, stored(*A[:2])))
        await index.remove_worker("w1")
        await index.remove_worker("never-seen")
        assert await index.match(A) == [PrefixMatch("w2", 2)]
        assert await index.cursor("w1") is None
        assert await index.num_entries() == 2
    backend.run(scenario)


def test_a_worker_that_stops_heartbeating_expires(backend):
    async def scenario(index, backend):
        await index.apply(events("quiet", E1, 1, stored(*A[:4])))
        await index.apply(events("alive", E1, 1, stored(*A[:2])))
        await backend.elapse(0.6)
        await index.heartbeat("alive", E1)
        await backend.elapse(0.6)  # quiet: 1.2 s since its last word (lease 1 s); alive: 0.6 s
        assert await index.match(A) == [PrefixMatch("alive", 2)]
        assert await index.cursor("quiet") is None
        await index.apply(snapshot("quiet", E1, 1, A[:4]))  # it speaks again: a snapshot re-registers it
        assert await index.match(A) == [PrefixMatch("quiet", 4), PrefixMatch("alive", 2)]
    backend.run(scenario, lease_s=1.0)


def test_malformed_batches_are_rejected(backend):
    async def scenario(index, _):
        bad = KVEventBatch("w", E1, 3, ((1, stored(A[0])), (3, stored(A[1]))))
        with pytest.raises(ValueError):
            await index.apply(bad)
        with pytest.raises(ValueError):
            await index.match([b"short"])
        assert await index.cursor("w") is None
    backend.run(scenario)


def test_a_puller_following_a_worker_buffer_converges_to_its_cache(backend):
    """A worker's buffer overflows and the worker restarts; the index ends equal to its cache."""
    rng = random.Random(7)
    docs = [chain(6, doc=d) for d in range(12)]

    async def pull(index, buffer):
        cursor = await index.cursor(buffer.worker_id)
        since = cursor[1] if cursor is not None else 0
        await index.apply(buffer.read_since(since, max_events=5, epoch=cursor[0] if cursor else None))

    async def scenario(index, _):
        buffer, cached = KVEventBuffer("w", capacity=16, epoch=1), set()
        for step in range(400):
            if step == 200:  # restart: a fresh buffer, a new epoch, an empty cache
                buffer, cached = KVEventBuffer("w", capacity=16, epoch=2), set()
            doc = rng.choice(docs)
            blocks = doc[:rng.randint(1, 6)]
            if rng.random() < 0.6:
                new = [h for h in blocks if h not in cached]
                buffer.append(stored(*new))
                cached.update(new)
            else:
                gone = [h for h in blocks if h in cached]
                buffer.append(removed(*gone))
                cached.difference_update(gone)
            if rng.random() < 0.3:
                await pull(index, buffer)
        for _ in range(200):
            await pull(index, buffer)
        for doc in docs:
            expected = next((i for i, h in enumerate(doc) if h not in cached), len(doc))
            assert await index.match(doc) == ([PrefixMatch("w", expected)] if expected else [])
    backend.run(scenario)
