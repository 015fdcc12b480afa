"""What only the Redis Cluster index has: block entries spread over the shards, URL forms, and a shard
killed under routing load costing hits, never requests. (The contract tests run against it too.)
The shard-kill test runs last: it leaves the module's cluster one shard short."""
from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from common.kv_events import KVEventBatch
from common.redis_url import parse_redis_url
from engine.block_hash import HashNamespace, hash_blocks
from policies.routing import RouteQuery, WorkerLoad
from policies.routing.cache_aware import CacheAwarePolicy
from prefix_index import (
    IndexNamespace,
    PrefixIndexUnavailable,
    PrefixMatch,
    RedisClusterPrefixIndex,
    make_redis_index,
)
from tests.redis_cluster import REDIS_CLI

HNS = HashNamespace("cluster-model", 4)
EPOCH = 1_700_000_000_000_000_000


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def doc(n: int, blocks: int = 24) -> list[bytes]:
    return hash_blocks(HNS, [n * 100_000 + i for i in range(4 * blocks)])


def keys_per_node(cluster) -> list[int]:
    return [int(subprocess.run([REDIS_CLI, "-p", str(node.port), "dbsize"], capture_output=True, text=True,
                               timeout=10).stdout) for node in cluster.nodes]


def test_cluster_urls_parse_and_bad_ones_name_the_field():
    target = parse_redis_url("redis+cluster://10.0.0.1:7000,[::1]:7001/0")
    assert target.cluster and target.seeds == (("10.0.0.1", 7000), ("::1", 7001))
    assert not parse_redis_url("redis://h:6379/0").cluster
    for bad in ("redis+cluster://", "redis+cluster://h", "redis+cluster://h:99999", "http://h:1",
                "redis+cluster://u:p@h:1"):
        with pytest.raises(ValueError, match=r"^redis_url: "):
            parse_redis_url(bad)


def test_block_entries_spread_over_every_shard(redis_cluster):
    async def main():
        namespace = IndexNamespace("spread-model", 4)
        index = make_redis_index(redis_cluster.url, namespace, lease_s=30)
        assert isinstance(index, RedisClusterPrefixIndex)
        before = keys_per_node(redis_cluster)
        hashes = [h for d in range(20) for h in doc(d, 15)]  # 300 blocks
        await index.apply(KVEventBatch("w1", EPOCH, 1, (), tuple(hashes)))
        added = [after - b for after, b in zip(keys_per_node(redis_cluster), before, strict=True)]
        assert sum(added) >= 300 and min(added) >= 60, added  # about a third each, never one shard
        assert await index.match(doc(3, 15)) == [PrefixMatch("w1", 15)]
        await index.check_integrity()
        await index.remove_worker("w1")
        assert keys_per_node(redis_cluster) == before  # every holder map emptied and gone
        await index.close()
    run(main())


def test_a_connection_closed_under_a_command_is_unavailable_not_a_client_error(redis_cluster):
    """redis-py's asyncio cluster client closes every connection of its nodes after a connection error or
    a topology change (its own `aclose`), also those other coroutines are sending on: such a command fails
    inside the client with an AttributeError (the connection's writer is gone). The index must report it
    as `PrefixIndexUnavailable`, as any other "no answer now". Lookups are put in flight and the client
    closes its connections under them, until a trial hits the half-closed case."""
    async def main():
        docs = [doc(d) for d in range(32)]
        causes: list[str] = []
        for trial in range(40):
            index = make_redis_index(redis_cluster.url, IndexNamespace(f"half-open-{trial}", 4), lease_s=60,
                                     timeout_s=2.0)
            await index.apply(KVEventBatch("w0", EPOCH, 1, (), tuple(docs[0])))
            lookups = [asyncio.ensure_future(index.match(d)) for d in docs]
            for _ in range(1 + trial % 3):  # the lookups start sending
                await asyncio.sleep(0)
            await index._redis.aclose()  # what the client does itself after a connection error
            for outcome in await asyncio.gather(*lookups, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, PrefixIndexUnavailable), repr(outcome)
                    causes.append(type(outcome.__cause__).__name__)
                else:
                    assert isinstance(outcome, list)
            await index.close()
            if "AttributeError" in causes:
                break
        assert "AttributeError" in causes, f"no trial closed a connection under a command: {causes}"
    run(main(), timeout_s=120.0)


def test_a_killed_shard_costs_hits_never_requests(redis_cluster):
    """Routers route a steady stream through `cache_aware` over the cluster index; one shard (not the
    registry's) dies mid-stream. Every request still gets a worker, each decision stays bounded in time
    (most skip the dead shard at once), and the hits that needed the dead shard are lost."""
    async def main():
        namespace = IndexNamespace("kill-model", 4)
        writer = make_redis_index(redis_cluster.url, namespace, lease_s=60, timeout_s=0.5)
        reader = make_redis_index(redis_cluster.url, namespace, lease_s=60, timeout_s=0.5)
        docs = [doc(d) for d in range(30)]
        workers = [f"w{i}" for i in range(6)]
        for i, worker in enumerate(workers):
            held = tuple(h for d in docs[i::6] for h in d)
            await writer.apply(KVEventBatch(worker, EPOCH, 1, (), held))
        policy = CacheAwarePolicy(reader)
        registry_key = reader._registry[0]

        def holds_registry(node) -> bool:
            out = subprocess.run([REDIS_CLI, "-p", str(node.port), "exists", registry_key], capture_output=True,
                                 text=True, timeout=10).stdout
            return out.strip() == "1"

        loads = [WorkerLoad(w, 0, 0) for w in workers]

        async def route(n: int):
            hashes = docs[n % len(docs)]
            start = time.monotonic()
            decision = await policy.choose(RouteQuery(tuple(hashes), 4 * len(hashes), 4, b"%d" % n), loads)
            return decision, time.monotonic() - start

        before = [await route(n) for n in range(30)]
        redis_cluster.kill(next(i for i, node in enumerate(redis_cluster.nodes) if not holds_registry(node)))
        after = [await route(n) for n in range(30)]
        assert all(d.worker_id in workers for d, _ in before + after)  # never a failed request
        assert max(s for _, s in after) < 1.5  # bounded by the index's timeouts, not a hang
        assert sorted(s for _, s in after)[len(after) // 2] < 0.1  # the dead shard is skipped, not awaited
        hits_before = sum(d.expected_cached_blocks for d, _ in before)
        hits_after = sum(d.expected_cached_blocks for d, _ in after)
        assert hits_before == 30 * 24  # every prompt fully held by its worker while all shards live
        assert hits_after < hits_before  # the blocks the dead shard held count no more
        for index in (writer, reader):
            await index.close()
    run(main())
