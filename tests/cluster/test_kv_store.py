"""KV that outlives the worker that computed it (real Ray actors, real redis-server, a real 3-shard Redis
Cluster): blocks one prefill worker computed are fetched from the shared store by another and by a
restarted one, from the host tier when the store is gone, and by the prefill worker that resumes a
request whose decode instance was SIGKILLed (decode stores its blocks as they fill); every output
equals HF transformers; a corrupt block in the store is recomputed, tenants never share blocks, and
Redis dying under load fails no request (served by a decode instance of two ranks); a decode instance of
two ranks stores each block as two head shards, and a request resumed off it after one of its ranks was
SIGKILLed reads them back whole (and the router prices them as held)."""

from __future__ import annotations

import contextlib
import random
import signal
import time
from dataclasses import replace

import pytest
import ray
import redis

from cluster.client import ClusterClient
from common.config import ClusterConfig, PoolConfig
from common.kv_store_config import KVStoreConfig
from common.messages import GenerateRequest
from engine import SamplingParams
from router.request_keys import route_query
from splitserve_client.client import Client
from tests.cluster.conftest import run
from tests.cluster.test_migration import Streams
from tests.factories import NUM_SPECIAL_TOKENS, TinySpec, hf_greedy_generate
from tests.redis_cluster import RedisClusterNodes
from tests.redis_server import RedisServer
from tests.router.cleanliness import wait_workers_clean
from tests.router.conftest import router_config, start_router

pytestmark = pytest.mark.timeout(300)
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SPEC = TinySpec(max_position_embeddings=2560)  # room for the 2k-token contexts of the migration test


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(NUM_SPECIAL_TOKENS, SPEC.vocab_size) for _ in range(n)]


def _stack(model_dir, store_url: str, tmp_dir, replicas: int, num_kv_blocks: int, decode_tp: int = 1):
    base = router_config()
    pool = PoolConfig(num_cpus=0.5, num_kv_blocks=num_kv_blocks, threads=1, replicas=replicas)
    kv_store = KVStoreConfig(url=store_url, host_tier_bytes=4 << 20, host_tier_dir=str(tmp_dir), retry_after_s=0.2)
    config: ClusterConfig = replace(
        base,
        prefill=pool,
        decode=replace(pool, num_kv_blocks=512, tp_size=decode_tp),
        block_size=BLOCK,
        kv_store=kv_store,
        handoff_lease_s=6.0,
    )
    return start_router(model_dir, config)


@pytest.fixture(scope="module")
def cluster_store(ray_session, checkpoint, tmp_path_factory):
    """P2D2 over a 3-shard Redis Cluster (and a disk host tier on every worker)."""
    with RedisClusterNodes(3, workdir=str(tmp_path_factory.mktemp("redis-cluster"))) as nodes:
        stack = _stack(checkpoint(SPEC), nodes.url, tmp_path_factory.mktemp("tier"), replicas=2, num_kv_blocks=256)
        yield stack, nodes
        stack.stop()


@pytest.fixture(scope="module")
def single_store(ray_session, checkpoint, tmp_path_factory):
    """P1D1 over one redis-server, prefill pools small enough to evict (host tier: a disk file); the decode
    instance has two ranks, each storing its KV heads of the blocks its sequences fill."""
    with RedisServer(workdir=str(tmp_path_factory.mktemp("redis"))) as server:
        model_dir, tier_dir = checkpoint(SPEC), tmp_path_factory.mktemp("tier")
        stack = _stack(model_dir, server.url, tier_dir, replicas=1, num_kv_blocks=40, decode_tp=2)
        yield stack, server
        stack.stop()


def _members(stack):
    """The cluster's membership now (the launch snapshot may predate late workers)."""
    deadline_s = time.monotonic() + 60
    while True:
        stack.cluster.refresh()
        if (
            len(stack.cluster.prefill) == stack.config.prefill.replicas
            and len(stack.cluster.decode) == stack.config.decode.replicas
        ):
            return stack.cluster
        assert time.monotonic() < deadline_s, "the pools did not reach full strength"
        time.sleep(0.1)


def _generate(cluster, request: GenerateRequest, prefill_index: int):
    async def go():
        client = ClusterClient(cluster)
        try:
            tokens, first = [], None
            async for chunk in client.generate(request, prefill=cluster.prefill[prefill_index]):
                first = first or chunk
                tokens += chunk.token_ids
            return tokens, first
        finally:
            await client.close()

    return run(go())


def _sigkill(actor) -> None:
    with contextlib.suppress(ray.exceptions.RayActorError):  # it may die before it answers
        ray.get(actor.debug_signal.remote(signal.SIGKILL), timeout=10)


def _rank_actor(member, rank: int):
    """Rank `rank` of a decode instance's current start (its actors are named by instance, epoch, rank)."""
    suffix = f":{member.worker_id}@{member.epoch}/rank{rank}"
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(suffix)]
    assert len(named) == 1, named
    return ray.get_actor(named[0]["name"], namespace=named[0]["namespace"])


def _tier_stats(members) -> list[dict]:
    return ray.get([m.actor.kv_tier_stats.remote() for m in members], timeout=30)


def _wait_stored(members, at_least: int, tier: str = "redis", timeout_s: float = 20.0) -> None:
    """Until the workers' writers have written `at_least` blocks to `tier` in all (writes are asynchronous)."""
    deadline_s = time.monotonic() + timeout_s
    while sum(s.get(tier, {}).get("writes", 0) for s in _tier_stats(members)) < at_least:
        assert time.monotonic() < deadline_s, _tier_stats(members)
        time.sleep(0.05)


def test_a_prefix_one_worker_stored_is_fetched_by_another_and_equals_hf(cluster_store, checkpoint):
    stack, _ = cluster_store
    cluster, model_dir = _members(stack), checkpoint(SPEC)
    shared = _tokens(6 * BLOCK, seed=1)
    first, second = shared + _tokens(5, 2), shared + _tokens(9, 3)
    got_first, chunk = _generate(cluster, GenerateRequest("st-a", tuple(first), GREEDY), 0)
    assert chunk.num_cached_tokens == 0
    _wait_stored(cluster.prefill, 6)
    got_second, chunk = _generate(cluster, GenerateRequest("st-b", tuple(second), GREEDY), 1)
    assert chunk.num_cached_tokens == 6 * BLOCK  # worker 1 never computed it: it came from the store
    fetched = _tier_stats([cluster.prefill[1]])[0]["worker"]
    assert fetched["blocks_fetched"] >= 6
    assert fetched["blocks_stored"] == 0, "blocks fetched from the store are not written back to it"
    assert [got_first, got_second] == hf_greedy_generate(model_dir, [first, second], GREEDY.max_tokens)
    wait_workers_clean(cluster)
    # The router sees the store as a location: it learns the KV layout from the workers' stats and then
    # finds the stored prefix in the store itself (what cache_aware prices a fetch of).
    location, info = stack.server.service.store_location, stack.server.service.info
    deadline_s = time.monotonic() + 20
    while location.layout is None:
        assert time.monotonic() < deadline_s, "no prefill worker reported its KV layout"
        time.sleep(0.1)
    query = route_query(second, "", info.model_identity, BLOCK)
    assert stack.loop.call(location.held_blocks(query.block_hashes)) == 6
    unseen = route_query(_tokens(4 * BLOCK, 4), "", info.model_identity, BLOCK)
    assert stack.loop.call(location.held_blocks(unseen.block_hashes)) == 0
    deadline_s = time.monotonic() + 20  # `splitserve status` shows each worker's tiers and their hits
    while True:
        with Client(stack.target) as client:
            workers = client.status().workers
        prefill_tiers = [t for w in workers if w["role"] == "prefill" for t in w["kv_tiers"]]
        if sum(t["hits"] for t in prefill_tiers if t["tier"] == "redis") >= 6:
            break
        assert time.monotonic() < deadline_s, workers
        time.sleep(0.2)
    assert {t["tier"] for t in prefill_tiers} == {"disk", "redis"}


def test_a_corrupt_block_is_recomputed_and_tenants_never_share_blocks(cluster_store, checkpoint):
    stack, nodes = cluster_store
    cluster, model_dir = _members(stack), checkpoint(SPEC)
    shared = _tokens(4 * BLOCK, seed=10)
    before = sum(s.get("redis", {}).get("writes", 0) for s in _tier_stats(cluster.prefill))
    _generate(cluster, GenerateRequest("cb-a", tuple(shared + _tokens(3, 11)), GREEDY), 0)
    _wait_stored(cluster.prefill, before + 4)
    for node in nodes.nodes:  # flip the last payload byte of every stored block, shard by shard
        client = redis.Redis(host="127.0.0.1", port=node.port)
        for key in client.keys("kvb:*"):
            record = bytearray(client.get(key))
            record[-1] ^= 0xFF
            client.set(key, bytes(record))
        client.close()
    prompts = [shared + _tokens(7, 12), shared + _tokens(7, 13)]
    got, chunk = _generate(cluster, GenerateRequest("cb-b", tuple(prompts[0]), GREEDY), 1)
    assert chunk.num_cached_tokens == 0, "corrupt records are misses"
    assert _tier_stats([cluster.prefill[1]])[0]["worker"]["records_refused"] >= 1
    other, chunk = _generate(cluster, GenerateRequest("cb-c", tuple(prompts[1]), GREEDY, tenant="t2"), 0)
    assert chunk.num_cached_tokens == 0, "another tenant's blocks have other keys"
    assert [got, other] == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    wait_workers_clean(cluster)


def test_a_migrated_stream_resumes_from_stored_blocks(cluster_store, checkpoint):
    stack, _ = cluster_store
    _members(stack)
    model_dir, members = checkpoint(SPEC), stack.server.service.cluster.membership
    prompts = [_tokens(2000, seed=20 + i) for i in range(2)]
    max_tokens = 64
    for decode in members.decode:  # slow enough that the stream is still running at the kill
        ray.get(decode.actor.debug_set_step_delay.remote(0.1), timeout=10)
    fetched_before = sum(s["worker"]["blocks_fetched"] for s in _tier_stats(members.prefill))
    streams = Streams(
        stack.target, prompts, {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}, tag="mig"
    )
    streams.wait_tokens(2 * BLOCK + 2)
    time.sleep(0.3)  # the decode instances' writers store the generated blocks meanwhile
    victim = streams.route_decode(0)
    actor = next(d.actor for d in members.decode if d.worker_id == victim)
    _sigkill(actor)
    streams.join()
    assert streams.errors == [None, None]
    assert streams.tokens == hf_greedy_generate(model_dir, prompts, max_tokens)
    assert streams.finals[0].migrations >= 1
    members = stack.server.service.cluster.membership
    fetched = sum(s["worker"]["blocks_fetched"] for s in _tier_stats(members.prefill)) - fetched_before
    assert fetched >= 2, "the resumed request read its generated blocks from the store instead of recomputing"
    for decode in members.decode:
        ray.get(decode.actor.debug_set_step_delay.remote(0.0), timeout=10)


def test_host_tier_serves_when_the_pool_evicted_and_redis_is_gone(single_store, checkpoint):
    stack, server = single_store
    cluster, model_dir = _members(stack), checkpoint(SPEC)
    prompt = _tokens(8 * BLOCK, seed=30) + _tokens(4, 31)
    _generate(cluster, GenerateRequest("ht-a", tuple(prompt), GREEDY), 0)
    for i in range(5):  # 40-block pool: these evict the first prompt's blocks
        _generate(cluster, GenerateRequest(f"ht-fill{i}", tuple(_tokens(8 * BLOCK + 3, 40 + i)), GREEDY), 0)
    _wait_stored(cluster.prefill, 6 * 8, tier="disk")
    server.kill()
    again = prompt[:-4] + _tokens(6, 32)
    got, chunk = _generate(cluster, GenerateRequest("ht-b", tuple(again), GREEDY), 0)
    assert chunk.num_cached_tokens == 8 * BLOCK
    assert got == hf_greedy_generate(model_dir, [again], GREEDY.max_tokens)[0]
    server.start()
    wait_workers_clean(cluster)


def test_redis_dying_under_load_fails_nothing_and_a_restarted_prefill_pool_reads_the_store(single_store, checkpoint):
    stack, server = single_store
    cluster, model_dir = _members(stack), checkpoint(SPEC)
    if not server.ping():
        server.start()
    shared = _tokens(5 * BLOCK, seed=50)
    prompts = [shared + _tokens(4 + i, 60 + i) for i in range(6)]
    streams = Streams(stack.target, prompts, {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}, tag="rk")
    streams.wait_tokens(1)
    server.kill()
    streams.join()
    assert streams.errors == [None] * len(prompts)
    assert streams.tokens == hf_greedy_generate(model_dir, prompts, 8)  # a TP=2 decode instance, store on
    assert _tier_stats(cluster.decode)[0]["worker"]["blocks_stored"] > 0, "rank 0 stores its heads of filled blocks"
    server.start()
    before = sum(s.get("redis", {}).get("writes", 0) for s in _tier_stats(cluster.prefill))
    warm = _tokens(6 * BLOCK, seed=70)
    _generate(cluster, GenerateRequest("rk-warm", tuple(warm + _tokens(3, 71)), GREEDY), 0)
    _wait_stored(cluster.prefill, before + 6)  # the restarted store fills again
    old, old_epoch = cluster.prefill[0].worker_id, cluster.prefill[0].epoch
    _sigkill(cluster.prefill[0].actor)  # a rolling restart of the (one-worker) prefill pool: it restarts empty
    deadline_s = time.monotonic() + 60
    while True:
        cluster.refresh()
        if cluster.prefill and cluster.prefill[0].worker_id == old and cluster.prefill[0].epoch > old_epoch:
            break
        assert time.monotonic() < deadline_s, "the controller did not replace the prefill worker"
        time.sleep(0.2)
    after = warm + _tokens(5, 72)
    got, chunk = _generate(cluster, GenerateRequest("rk-after", tuple(after), GREEDY), 0)
    assert chunk.num_cached_tokens == 6 * BLOCK, "the replacement's first request hit the store"
    assert got == hf_greedy_generate(model_dir, [after], GREEDY.max_tokens)[0]
    wait_workers_clean(cluster)


def test_a_stream_resumed_off_a_tp2_instance_whose_rank_1_died_reads_the_shards_of_its_blocks(single_store, checkpoint):
    stack, server = single_store
    cluster, model_dir = _members(stack), checkpoint(SPEC)
    if not server.ping():
        server.start()
    prompts = [_tokens(300, seed=80 + i) for i in range(2)]
    max_tokens = 48
    decode = cluster.decode[0]
    ray.get(decode.actor.debug_set_step_delay.remote(0.1), timeout=10)  # still streaming at the kill
    follower = _rank_actor(decode, 1)
    assembled_before = sum(s["worker"]["blocks_assembled"] for s in _tier_stats(cluster.prefill))
    streams = Streams(
        stack.target, prompts, {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}, tag="tp"
    )
    streams.wait_tokens(2 * BLOCK + 2)  # 300 + 34 tokens: blocks 18 and 19 filled while decoding
    time.sleep(0.3)  # the ranks' writers store them meanwhile
    follower_stats = ray.get(follower.kv_tier_stats.remote(), timeout=10)
    assert follower_stats["worker"]["blocks_stored"] >= 2 * 2, follower_stats
    _sigkill(follower)
    streams.join()
    assert streams.errors == [None, None]
    assert streams.tokens == hf_greedy_generate(model_dir, prompts, max_tokens)
    assert all(final.migrations >= 1 for final in streams.finals)
    cluster = _members(stack)
    assembled = sum(s["worker"]["blocks_assembled"] for s in _tier_stats(cluster.prefill)) - assembled_before
    assert assembled >= 2 * 2, "each resumed stream read its generated blocks whole from the two ranks' shards"
    # The router prices those blocks as held too: the prompt's 18 blocks are whole records, blocks 18 and
    # 19 (filled while decoding) complete sets of the two ranks' shards, whose layouts the prefill
    # worker reports.
    location, info = stack.server.service.store_location, stack.server.service.info
    deadline_s = time.monotonic() + 20
    while len(location.shard_layouts) != 2:
        assert time.monotonic() < deadline_s, "no prefill worker reported the decode shards' layouts"
        time.sleep(0.1)
    for prompt, tokens in zip(prompts, streams.tokens, strict=True):
        query = route_query(prompt + tokens[: 2 * BLOCK + 2], "", info.model_identity, BLOCK)
        assert stack.loop.call(location.held_blocks(query.block_hashes)) >= 300 // BLOCK + 2
    wait_workers_clean(cluster)
