"""The router's view of the shared KV store (`policies/store_fetch_cost.py`) against a real redis-server:
it counts the leading blocks of a prompt the store holds (following the store's own contents, keyed
by the layout the workers report), and a store that goes away holds nothing, so `cache_aware` routes
by the pools alone and no request fails."""

from __future__ import annotations

import asyncio

import pytest
import redis

from common.kv_store_config import KVStoreConfig
from common.messages import StoreReads
from engine.block_hash import HashNamespace, hash_blocks
from kv_store.block_record import block_key
from kv_store.redis_store import RedisBlockStore
from policies.admission import PrefillCostModel
from policies.admission.cost_model import PrefillTimeFit
from policies.routing import RouteQuery, WorkerLoad
from policies.routing.cache_aware import CacheAwarePolicy
from policies.store_fetch_cost import StoreFetchCost
from prefix_index.memory import InProcessPrefixIndex
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)
NS = HashNamespace("model/store", 4)
LAYOUT = bytes(range(16))


class Stats:  # what a prefill worker's `WorkerStats` carries for this listener
    def __init__(self, reads: StoreReads):
        self.store_reads = reads


def test_the_router_reads_what_the_store_holds_and_routes_on_without_it(tmp_path):
    prompt = list(range(200, 240))  # 10 blocks of 4
    hashes = hash_blocks(NS, prompt)
    with RedisServer(workdir=str(tmp_path)) as server:
        writer = RedisBlockStore(server.url)
        writer.put_many([(block_key(LAYOUT, h), b"record") for h in hashes[:7]])
        prefill_cost = PrefillCostModel(prior=PrefillTimeFit(0.0, 1e-3, 0.0))  # 1 ms a token
        location = StoreFetchCost.from_config(KVStoreConfig(url=server.url, retry_after_s=0.2), 1000, prefill_cost)
        assert location is not None
        policy = CacheAwarePolicy(InProcessPrefixIndex(lease_s=30), store=location)
        query = RouteQuery(tuple(hashes), len(prompt), 4, b"p")
        loads = [WorkerLoad("a", 0, 0), WorkerLoad("b", 0, 0)]

        async def scenario() -> None:
            assert await location.held_blocks(hashes) == 0, "no worker reported its layout yet"
            location.observe_stats("p0", "prefill", 1, Stats(StoreReads(LAYOUT.hex(), 0, 0.0)))
            assert await location.held_blocks(hashes) == 7
            assert await location.held_blocks(hash_blocks(NS, [9, *prompt[1:]])) == 0  # another chain
            decision = await policy.choose(query, loads)
            # the read prior: 5 ms + 2 µs a block, so 7 blocks cost 6 tokens against 28 computed
            assert decision.store_blocks == 7
            server.kill()
            decision = await policy.choose(query, loads)
            assert decision.store_blocks == 0 and decision.worker_id in {"a", "b"}

        asyncio.run(scenario())
        location.close()
        writer.close()
    assert StoreFetchCost.from_config(KVStoreConfig(), 1000, prefill_cost) is None


SHARDS = (bytes(range(16, 32)), bytes(range(32, 48)))  # the layouts of a TP 2 decode instance's head ranges


def test_a_block_stored_as_a_complete_set_of_head_shards_is_priced_like_a_whole_record(tmp_path):
    """A migrated request's chain: prompt blocks whole (a prefill worker's), generated ones as the head
    shards of a TP decode instance's ranks. A block counts as held whole or with every shard; one
    missing shard ends the run there, as a missing whole record does."""
    prompt = list(range(300, 340))  # 10 blocks of 4
    hashes = hash_blocks(NS, prompt)
    with RedisServer(workdir=str(tmp_path)) as server:
        writer = RedisBlockStore(server.url)
        writer.put_many([(block_key(LAYOUT, h), b"record") for h in hashes[:3]])
        writer.put_many([(block_key(shard, h), b"shard") for h in hashes[3:6] for shard in SHARDS])
        writer.put_many([(block_key(SHARDS[0], hashes[6]), b"shard")])  # block 6: its second shard is lost
        writer.put_many([(block_key(shard, hashes[7]), b"shard") for shard in SHARDS])
        prefill_cost = PrefillCostModel(prior=PrefillTimeFit(0.0, 1e-3, 0.0))  # 1 ms a token
        location = StoreFetchCost.from_config(KVStoreConfig(url=server.url), 1000, prefill_cost)
        assert location is not None
        policy = CacheAwarePolicy(InProcessPrefixIndex(lease_s=30), store=location)
        loads = [WorkerLoad("a", 0, 0), WorkerLoad("b", 0, 0)]

        async def scenario() -> None:
            location.observe_stats("p0", "prefill", 1, Stats(StoreReads(LAYOUT.hex(), 0, 0.0)))
            assert await location.held_blocks(hashes) == 3, "shards of layouts no worker reported are not held"
            reads = StoreReads(LAYOUT.hex(), 0, 0.0, shard_layouts=tuple(s.hex() for s in SHARDS))
            location.observe_stats("p0", "prefill", 1, Stats(reads))
            assert await location.held_blocks(hashes) == 6, "blocks 3-5 held as shards; block 6 is not"
            assert await location.held_blocks(hashes[3:6]) == 3  # a chain of shards only
            assert await location.held_blocks(hashes[6:]) == 0  # an incomplete set is no block
            sharded = await policy.choose(RouteQuery(tuple(hashes[:6]), 24, 4, b"p"), loads)
            # the same blocks, all whole: the same price, the same decision
            writer.put_many([(block_key(LAYOUT, h), b"record") for h in hashes[3:6]])
            client = redis.Redis.from_url(server.url)
            assert client.delete(*[block_key(shard, h) for h in hashes[3:6] for shard in SHARDS]) == 6
            client.close()
            assert await location.held_blocks(hashes) == 6
            whole = await policy.choose(RouteQuery(tuple(hashes[:6]), 24, 4, b"p"), loads)
            assert sharded == whole and sharded.store_blocks == 6

        asyncio.run(scenario())
        location.close()
        writer.close()
