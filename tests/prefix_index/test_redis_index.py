"""What only the Redis index has: several routers on one Redis, one round trip per lookup, typed and
bounded failures when Redis dies or hangs, keys that expire with their worker, and the publisher."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis.asyncio as aioredis

from common.kv_events import KVEventBatch, KVEventBuffer
from prefix_index import (IndexNamespace, PrefixIndexUnavailable, PrefixMatch, RedisIndexPublisher,
                                  RedisPrefixIndex)
from engine.block_hash import HashNamespace, hash_blocks
from engine.block_pool import BlockRemoved, BlockStored

HNS = HashNamespace("redis-model", 4)
NS = IndexNamespace(HNS.model_identity, HNS.block_size)
EPOCH = 1_700_000_000_000_000_000
A = hash_blocks(HNS, list(range(4 * 16)))


def run(coro, timeout_s: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def holding(worker: str, hashes, epoch: int = EPOCH, last_seq: int = 1) -> KVEventBatch:
    return KVEventBatch(worker, epoch, last_seq, (), tuple(hashes))


async def wait_for_match(index, hashes, expected, timeout_s: float = 5.0):
    """Poll until `match` returns `expected`; return the time it took (fail after `timeout_s`)."""
    start = time.monotonic()
    while True:
        try:
            got = await index.match(hashes)
        except PrefixIndexUnavailable:
            got = "unavailable"
        if got == expected:
            return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"still {got} after {timeout_s} s, wanted {expected}"
        await asyncio.sleep(0.01)


def test_two_routers_on_one_redis_agree(redis_server):
    async def main():
        writer = RedisPrefixIndex(redis_server.url, NS, lease_s=30)
        routers = [RedisPrefixIndex(redis_server.url, NS, lease_s=lease_s) for lease_s in (5, 60)]
        await writer.apply(holding("w1", A[:7]))
        await writer.apply(holding("w2", A[:3]))
        want = [PrefixMatch("w1", 7), PrefixMatch("w2", 3)]
        assert [await r.match(A) for r in routers] == [want, want]
        assert [await r.cursor("w1") for r in routers] == [(EPOCH, 1), (EPOCH, 1)]
        await routers[0].remove_worker("w1")
        assert await routers[1].match(A) == [PrefixMatch("w2", 3)]
        for index in (writer, *routers):
            await index.check_integrity()
            await index.close()
    run(main())


def test_namespaces_never_share_entries(redis_server):
    async def main():
        names = [NS, IndexNamespace(NS.model_identity, 8), IndexNamespace("other-model", 4),
                 IndexNamespace(NS.model_identity, 4, hash_spec="blake2b-128/v2/u32le")]
        indexes = [RedisPrefixIndex(redis_server.url, ns, lease_s=30) for ns in names]
        await indexes[0].apply(holding("w", A))
        assert [await index.match(A) for index in indexes] == [[PrefixMatch("w", 16)], [], [], []]
        for index in indexes:
            await index.close()
    run(main())


def test_a_lookup_is_one_round_trip(redis_server):
    async def main():
        index = RedisPrefixIndex(redis_server.url, NS, lease_s=30)
        for worker in ("w1", "w2", "w3"):
            await index.apply(holding(worker, A[:5]))
        await index.match(A)  # loads the script once; from then on a lookup is one EVALSHA
        observer, marker = aioredis.Redis.from_url(redis_server.url), aioredis.Redis.from_url(redis_server.url)
        await marker.ping()  # connected before MONITOR starts, so its handshake is not in the log
        async with observer.monitor() as monitor:
            assert len(await index.match(A)) == 3
            await marker.echo("end-of-lookup")
            seen = []
            while "end-of-lookup" not in (command := await monitor.next_command())["command"]:
                seen.append(command)
        sent = [c["command"].split()[0] for c in seen if c["client_type"] != "lua"]
        assert sent == ["EVALSHA"], sent
        assert any(c["client_type"] == "lua" for c in seen)  # the work happened inside the script
        await observer.aclose()
        await marker.aclose()
        await index.close()
    run(main())


def test_dead_redis_fails_fast_with_a_typed_error_and_recovers_after_restart(redis_server):
    async def main():
        index = RedisPrefixIndex(redis_server.url, NS, lease_s=30, timeout_s=0.5)
        await index.apply(holding("w", A))
        redis_server.kill()
        for call in (index.match(A), index.cursor("w"), index.apply(holding("w", A)), index.heartbeat("w", EPOCH)):
            start = time.monotonic()
            with pytest.raises(PrefixIndexUnavailable):
                await call
            assert time.monotonic() - start < 1.0
        redis_server.start()
        assert await index.match(A) == []  # nothing is persisted: the publishers resync it
        assert await index.cursor("w") is None
        await index.apply(holding("w", A[:2]))
        assert await index.match(A) == [PrefixMatch("w", 2)]
        await index.check_integrity()
        await index.close()
    run(main())


def test_a_hung_redis_times_out_instead_of_hanging(redis_server):
    async def main():
        index = RedisPrefixIndex(redis_server.url, NS, lease_s=30, timeout_s=0.3)
        await index.apply(holding("w", A[:4]))
        redis_server.pause()
        try:
            start = time.monotonic()
            with pytest.raises(PrefixIndexUnavailable):
                await index.match(A)
            assert time.monotonic() - start < 2 * 0.3 + 0.3
        finally:
            redis_server.resume()
        assert await index.match(A) == [PrefixMatch("w", 4)]
        await index.close()
    run(main())


def test_a_dead_workers_keys_are_freed_by_redis(redis_server):
    async def main():
        short = RedisPrefixIndex(redis_server.url, NS, lease_s=0.3)
        await short.apply(holding("dead", A))
        observer = aioredis.Redis.from_url(redis_server.url)
        assert await observer.dbsize() == 3  # registry, cursor, block set
        deadline = time.monotonic() + 5
        while await observer.dbsize():  # Redis's own expiry reclaims them; no reaper involved
            assert time.monotonic() < deadline, await observer.keys("*")
            await asyncio.sleep(0.05)
        assert await short.match(A) == []
        await observer.aclose()
        await short.close()
    run(main())


def _feed(buffer: KVEventBuffer, hashes) -> None:
    for block_hash in hashes:
        buffer.append(BlockStored((block_hash,), None, (0, 0, 0, 0)))


def test_the_publisher_brings_a_workers_events_to_redis_quickly(redis_server):
    buffer = KVEventBuffer("w-pub", epoch=EPOCH)
    publisher = RedisIndexPublisher(buffer, redis_server.url, NS, lease_s=5, interval_s=0.02).start()

    async def main():
        router = RedisPrefixIndex(redis_server.url, NS, lease_s=5)
        _feed(buffer, A[:10])
        assert await wait_for_match(router, A, [PrefixMatch("w-pub", 10)], timeout_s=2.0) < 2.0
        buffer.append(BlockRemoved((A[4],)))
        await wait_for_match(router, A, [PrefixMatch("w-pub", 4)], timeout_s=2.0)
        await router.check_integrity()
        await router.close()
    try:
        run(main())
    finally:
        start = time.monotonic()
        publisher.stop(timeout_s=2.0)
    assert time.monotonic() - start < 2.0 and not publisher.running


def test_the_publisher_survives_a_redis_restart_and_resyncs(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="prefix_index.publisher")
    buffer = KVEventBuffer("w-pub", capacity=4, epoch=EPOCH)
    publisher = RedisIndexPublisher(buffer, redis_server.url, NS, lease_s=5, interval_s=0.02, max_backoff_s=0.1,
                                    timeout_s=0.3).start()

    async def main():
        router = RedisPrefixIndex(redis_server.url, NS, lease_s=5, timeout_s=0.3)
        _feed(buffer, A[:3])
        await wait_for_match(router, A, [PrefixMatch("w-pub", 3)])
        redis_server.kill()
        _feed(buffer, A[3:12])  # more than the buffer holds: only a snapshot can carry it now
        await asyncio.sleep(0.5)  # several failed cycles, one warning
        redis_server.start()
        await wait_for_match(router, A, [PrefixMatch("w-pub", 12)])
        await router.check_integrity()
        await router.close()
    try:
        run(main())
    finally:
        publisher.stop(timeout_s=2.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert publisher.outages == 1 and len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_stopping_the_publisher_is_bounded_while_redis_hangs(redis_server):
    buffer = KVEventBuffer("w-pub", epoch=EPOCH)
    publisher = RedisIndexPublisher(buffer, redis_server.url, NS, lease_s=5, interval_s=0.02,
                                    timeout_s=0.3).start()
    _feed(buffer, A[:2])
    redis_server.pause()
    try:
        time.sleep(0.1)  # let a cycle get stuck on the hung server
        start = time.monotonic()
        publisher.stop(timeout_s=3.0)
        assert time.monotonic() - start < 2 * 0.3 + 0.5
        assert not publisher.running
    finally:
        redis_server.resume()


def test_a_publisher_of_an_older_epoch_steps_aside(redis_server):
    old = KVEventBuffer("w-pub", epoch=EPOCH)
    _feed(old, A[:9])

    async def main():
        router = RedisPrefixIndex(redis_server.url, NS, lease_s=5)
        await router.apply(holding("w-pub", A[:2], epoch=EPOCH + 1))  # the worker's newer start
        publisher = RedisIndexPublisher(old, redis_server.url, NS, lease_s=5, interval_s=0.02).start()
        try:
            deadline = time.monotonic() + 2
            while not publisher.superseded:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert await router.match(A) == [PrefixMatch("w-pub", 2)]
            assert await router.cursor("w-pub") == (EPOCH + 1, 1)
        finally:
            publisher.stop(timeout_s=2.0)
            await router.close()
    run(main())
