"""The `BlockStore` contract, run against every tier: the host tier in memory, the memory-mapped disk
tier, one real redis-server, and a real 3-shard Redis Cluster."""

from __future__ import annotations

import threading
import time

import pytest

from kv_store.base import BlockStore
from kv_store.host_tier import DiskTier, MemoryTier
from kv_store.redis_store import RedisBlockStore
from kv_store.tiers import StoreWriter, TieredStore
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)
RECORD_BYTES = 64


def _record(i: int) -> bytes:
    return bytes([i % 251]) * RECORD_BYTES


def _key(i: int) -> bytes:
    return f"kvb:test:{i:04d}".encode()


@pytest.fixture(scope="module")
def redis_single(tmp_path_factory):
    with RedisServer(workdir=str(tmp_path_factory.mktemp("redis"))) as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    from tests.redis_cluster import RedisClusterNodes

    with RedisClusterNodes(3, workdir=str(tmp_path_factory.mktemp("redis-cluster"))) as nodes:
        yield nodes


@pytest.fixture(params=["host", "disk", "redis", "redis-cluster"])
def store(request, tmp_path) -> BlockStore:
    if request.param == "host":
        tier: BlockStore = MemoryTier(capacity_bytes=3 * RECORD_BYTES)
    elif request.param == "disk":
        tier = DiskTier(tmp_path, capacity_bytes=3 * RECORD_BYTES, slot_bytes=RECORD_BYTES)
    elif request.param == "redis":
        server = request.getfixturevalue("redis_single")
        tier = RedisBlockStore(server.url)
        tier.put_many([])  # connects lazily; the test flushes below
        _flush_single(server.url)
    else:
        nodes = request.getfixturevalue("redis_cluster")
        nodes.flush_all()
        tier = RedisBlockStore(nodes.url)
    yield tier
    tier.close()


def _flush_single(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    client.close()


def test_what_is_put_is_got_back_in_key_order_and_misses_are_none(store):
    assert store.put_many([(_key(i), _record(i)) for i in range(3)]) == 3
    assert store.get_many([_key(2), _key(9), _key(0)]) == [_record(2), None, _record(0)]
    assert store.get_many([]) == []
    assert store.stats.hits == 2 and store.stats.misses == 1
    assert store.stats.writes == 3 and store.stats.write_bytes == 3 * RECORD_BYTES


def test_a_put_replaces_the_value_under_its_key(store):
    store.put_many([(_key(1), _record(1))])
    store.put_many([(_key(1), _record(7))])
    assert store.get_many([_key(1)]) == [_record(7)]


def test_concurrent_writers_and_readers_see_whole_values(store):
    errors = []

    def work(offset: int) -> None:
        for i in range(offset, offset + 20):
            store.put_many([(_key(i % 3), _record(i % 3))])
            got = store.get_many([_key(i % 3)])[0]
            if got not in (None, _record(i % 3)):
                errors.append(got)

    threads = [threading.Thread(target=work, args=(n * 20,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_bounded_tiers_evict_the_least_recently_used(kind, tmp_path):
    tier = MemoryTier(3 * RECORD_BYTES) if kind == "host" else DiskTier(tmp_path, 3 * RECORD_BYTES, RECORD_BYTES)
    tier.put_many([(_key(i), _record(i)) for i in range(3)])
    tier.get_many([_key(0)])  # 0 is now the most recent: 1 goes first
    tier.put_many([(_key(3), _record(3))])
    assert tier.get_many([_key(i) for i in range(4)]) == [_record(0), None, _record(2), _record(3)]
    assert tier.stats.evictions == 1 and tier.stats.used_bytes == 3 * RECORD_BYTES
    assert tier.put_many([(_key(9), b"x" * (4 * RECORD_BYTES))]) == 0  # larger than the tier: not stored
    tier.close()
    assert tier.get_many([_key(0)]) == [None]
    if kind == "disk":
        assert not list(tmp_path.iterdir()), "the tier's file is removed on close"


def test_a_dead_redis_answers_misses_quickly_and_a_restarted_one_fills_again(tmp_path):
    with RedisServer(workdir=str(tmp_path / "redis")) as server:
        store = RedisBlockStore(server.url, timeout_s=0.5, retry_after_s=0.2)
        assert store.put_many([(_key(1), _record(1))]) == 1
        server.kill()
        started_s = time.monotonic()
        for _ in range(20):  # a request's worth of lookups while it is down: none raises, none waits long
            assert store.get_many([_key(1)]) == [None]
            assert store.put_many([(_key(2), _record(2))]) == 0
        assert time.monotonic() - started_s < 2.0
        assert store.stats.errors >= 1
        server.start()
        time.sleep(0.25)
        assert store.put_many([(_key(3), _record(3))]) == 1
        assert store.get_many([_key(3)]) == [_record(3)]
        store.close()


def test_a_tiered_read_answers_the_leading_run_and_fills_the_upper_tier(tmp_path):
    host, disk = MemoryTier(10 * RECORD_BYTES), DiskTier(tmp_path, 10 * RECORD_BYTES, RECORD_BYTES)
    host.put_many([(_key(1), _record(1))])
    disk.put_many([(_key(i), _record(i)) for i in (0, 2, 4)])
    tiers = TieredStore([host, disk])
    assert tiers.fetch_chain([_key(i) for i in range(5)]) == [_record(0), _record(1), _record(2)]
    assert host.get_many([_key(0), _key(2)]) == [_record(0), _record(2)], "lower hits are promoted"
    refused = tiers.fetch_chain([_key(i) for i in range(3)], accept=lambda index, _: index != 1)
    assert refused == [_record(0)], "a refused record ends the run like a miss"
    tiers.close()


def test_the_writer_writes_off_the_callers_thread_and_drops_rather_than_blocks(tmp_path):
    tier = MemoryTier(100 * RECORD_BYTES)
    writer = StoreWriter([tier], max_queued_batches=2)
    for i in range(10):
        writer.submit([(_key(i), _record(i))])
    assert writer.flush(10.0)
    written = [record for record in tier.get_many([_key(i) for i in range(10)]) if record is not None]
    assert len(written) + writer.dropped_batches == 10 and written
    writer.close()
