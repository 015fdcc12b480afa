"""The prefix index's tier rule (prefix_index/base.py): pool and host-tier entries of each worker, run
against every implementation (in-process, Redis, a 3-shard Redis Cluster) like the rest of the contract."""
from __future__ import annotations

import random

import pytest

from common.kv_events import KVEventBatch, KVEventBuffer
from engine.block_pool import MEDIUM_HOST, BlockRemoved, BlockStored
from prefix_index import PrefixMatch
from tests.prefix_index.test_prefix_index_contract import (  # noqa: F401 - `backend` is a fixture
    E1,
    E2,
    A,
    B,
    backend,
    chain,
    events,
    removed,
    stored,
)


def host_stored(*hashes) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), medium=MEDIUM_HOST)


def host_removed(*hashes) -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium=MEDIUM_HOST)


def test_match_counts_the_pool_run_then_the_host_tier_beyond_it(backend):
    async def scenario(index, _):
        await index.apply(events("w-a", E1, 1, stored(*A[:2]), host_stored(*A[:6])))
        await index.apply(events("w-b", E1, 1, stored(*A[:3])))
        await index.apply(events("w-c", E1, 1, host_stored(*A[:5]), stored(*B)))
        assert await index.match(A) == [
            PrefixMatch("w-b", 3, 0),
            PrefixMatch("w-a", 2, 4),
            PrefixMatch("w-c", 0, 5),  # host tier only: listed, with no pool blocks
        ]
        assert await index.match(B) == [PrefixMatch("w-c", len(B), 0)]
        levels = await index.holder_levels(A)
        assert list(levels.depths) == [3, 2]  # depths and members count the pool only
        assert levels.blocks_of("w-c") == 0 and levels.blocks_of("w-a") == 2
        assert sorted(levels.host_extended()) == [PrefixMatch("w-a", 2, 4), PrefixMatch("w-c", 0, 5)]
        assert await index.num_entries() == 2 + 6 + 3 + 5 + len(B)
    backend.run(scenario)


def test_the_chain_continues_through_either_medium(backend):
    async def scenario(index, _):
        # pool: blocks 0, 2, 3; host tier: block 1 (the pool evicted it): served 0 from the pool, 1-3 after
        await index.apply(events("w", E1, 1, stored(A[0], A[2], A[3]), host_stored(A[1])))
        assert await index.match(A) == [PrefixMatch("w", 1, 3)]
        await index.apply(events("w", E1, 3, host_removed(A[1])))  # the host tier evicts it
        assert await index.match(A) == [PrefixMatch("w", 1, 0)]
        await index.apply(events("w", E1, 4, host_stored(*A[1:5]), removed(A[0])))
        assert await index.match(A) == []  # block 0 is nowhere: nothing leads
        await index.apply(events("w", E1, 6, host_stored(A[0])))
        assert await index.match(A) == [PrefixMatch("w", 0, 5)]
    backend.run(scenario)


def test_a_snapshot_replaces_both_media_and_a_restart_drops_both(backend):
    async def scenario(index, _):
        await index.apply(events("w", E1, 1, stored(*A[:2]), host_stored(*A)))
        await index.apply(KVEventBatch("w", E1, 9, (), tuple(B[:1]), tuple(B[:4])))
        assert await index.match(A) == []
        assert await index.match(B) == [PrefixMatch("w", 1, 3)]
        await index.heartbeat("w", E2)  # restarted: its pool and host tier are both gone
        assert await index.match(B) == []
        await index.apply(events("v", E1, 1, host_stored(*A[:3])))
        await index.remove_worker("v")
        assert await index.match(A) == [] and await index.num_entries() == 0
    backend.run(scenario)


def test_host_only_batches_without_a_snapshot_are_rejected(backend):
    async def scenario(index, _):
        with pytest.raises(ValueError, match="host_snapshot"):
            await index.apply(KVEventBatch("w", E1, 1, ((1, stored(A[0])),), None, (A[1],)))
        with pytest.raises(ValueError, match="medium"):
            await index.apply(events("w", E1, 1, BlockStored((A[0],), None, (), medium="disk")))
    backend.run(scenario)


def test_a_puller_following_pool_and_host_events_converges(backend):
    """Pool and host-tier events interleaved, a buffer that overflows (snapshots carry both) and a
    restart: the index ends equal to what the worker's pool and host tier hold."""
    rng = random.Random(11)
    docs = [chain(6, doc=d) for d in range(10)]

    async def pull(index, buffer):
        cursor = await index.cursor(buffer.worker_id)
        since = cursor[1] if cursor is not None else 0
        await index.apply(buffer.read_since(since, max_events=5, epoch=cursor[0] if cursor else None))

    async def scenario(index, _):
        buffer, pool, host = KVEventBuffer("w", capacity=16, epoch=1), set(), set()
        for step in range(400):
            if step == 200:
                buffer, pool, host = KVEventBuffer("w", capacity=16, epoch=2), set(), set()
            blocks = rng.choice(docs)[: rng.randint(1, 6)]
            held, medium = (host, MEDIUM_HOST) if rng.random() < 0.5 else (pool, "pool")
            if rng.random() < 0.6:
                buffer.append(BlockStored(tuple(blocks), None, (), medium=medium))
                held.update(blocks)
            else:
                buffer.append(BlockRemoved(tuple(blocks), medium=medium))
                held.difference_update(blocks)
            if rng.random() < 0.3:
                await pull(index, buffer)
        for _ in range(200):
            await pull(index, buffer)
        for doc in docs:
            in_pool = next((i for i, h in enumerate(doc) if h not in pool), len(doc))
            reach = next((i for i, h in enumerate(doc) if h not in pool | host), len(doc))
            expected = [PrefixMatch("w", in_pool, reach - in_pool)] if reach else []
            assert await index.match(doc) == expected
            levels = await index.holder_levels(doc)
            assert list(levels.host_extended()) == [m for m in expected if m.num_host_blocks]
    backend.run(scenario)
