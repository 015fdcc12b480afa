"""Routers over the Redis prefix index (a real redis-server): worker events → Redis → routing, two
routers agreeing, tenant isolation, leases of a dead worker, and Redis dying mid-load."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import ray

from splitserve_client.client import AsyncClient, Client
from tests.factories import TinySpec
from tests.redis_server import RedisServer
from tests.router.conftest import LoopThread, RouterStack, router_config, start_router

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
PREFIX = list(range(100, 164))  # 4 blocks of 16


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(workdir=str(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def two_routers(ray_session, checkpoint, redis):
    from router.server import RouterServer

    config = router_config(policy="cache_aware")
    config = replace(config, redis_url=redis.url, index_lease_s=3.0,
                     prefill=replace(config.prefill, replicas=2))
    first = start_router(checkpoint(TinySpec()), config)
    loop = LoopThread()
    second = RouterStack(first.cluster, loop.call(RouterServer.start(first.cluster, config)), loop, config)
    yield first, second
    second.loop.call(second.server.stop(grace_s=1.0))
    second.loop.close()
    first.stop()


def test_events_reach_redis_and_both_routers_send_the_prefix_to_its_holder(two_routers):
    first, second = two_routers
    with Client(first.target) as a, Client(second.target) as b:
        holder = a.generate(PREFIX + [1], **GREEDY).route.prefill_worker
        _wait_until(lambda: b.status().index_entries >= 4, "the worker's blocks did not reach Redis")
        routes = [client.generate(PREFIX + [2 + i], **GREEDY).route for i, client in enumerate((a, b, b, a))]
    assert {r.prefill_worker for r in routes} == {holder}
    assert all(r.cached_prompt_tokens == 64 for r in routes)
    cold = [list(range(s, s + 40)) for s in (300, 340, 380, 420)]
    with Client(first.target) as a, Client(second.target) as b:  # idle cluster: cold prefixes agree too
        assert [a.generate(p, **GREEDY).route.prefill_worker for p in cold] == \
               [b.generate(p + [9], **GREEDY).route.prefill_worker for p in cold]
    first.check_workers_clean()


def test_a_tenant_never_hits_another_tenants_prefix(two_routers):
    first, _ = two_routers
    prompt = list(range(200, 264))
    with Client(first.target) as client:
        client.generate(prompt + [1], tenant="acme", **GREEDY)
        time.sleep(0.3)
        other = client.generate(prompt + [2], tenant="globex", **GREEDY).route
        same = client.generate(prompt + [3], tenant="acme", **GREEDY).route
    assert other.cached_prompt_tokens == 0 and same.cached_prompt_tokens == 64


def test_redis_killed_mid_load_fails_no_request_and_routing_recovers(two_routers, redis):
    first, second = two_routers
    prompts = [PREFIX + [i % 7, i] for i in range(60)]

    async def load():
        async with AsyncClient(first.target) as a, AsyncClient(second.target) as b:
            async def one(i, prompt):
                await asyncio.sleep(i * 0.05)
                return await (a if i % 2 else b).generate(prompt, **GREEDY)
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    async def chaos():
        await asyncio.sleep(0.8)
        redis.kill()
        await asyncio.sleep(1.0)
        redis.restart()

    async def both():
        done, _ = await asyncio.gather(load(), chaos())
        return done

    completions = asyncio.run(asyncio.wait_for(both(), 120))
    assert len(completions) == 60 and all(len(c.token_ids) == 6 for c in completions)  # zero failures
    assert first.server.service.policy.index_failures + second.server.service.policy.index_failures > 0
    with Client(first.target) as client:  # the publishers resync; cache-aware routing finds the holder again
        _wait_until(lambda: client.status().index_entries >= 4, "the index did not recover after Redis restarted")
        assert client.generate(PREFIX + [99], **GREEDY).route.cached_prompt_tokens == 64
    first.check_workers_clean()


def test_a_dead_workers_entries_leave_the_index_at_once(two_routers):
    """The controller drops a dead worker's entries when it removes it from membership (well inside the
    index lease); its replacement (same slot, new epoch) starts with none."""
    first, _ = two_routers
    first.cluster.refresh()
    with Client(first.target) as client:
        client.generate(PREFIX + [77], **GREEDY)
        victim = max(first.cluster.prefill, key=lambda member: _entries_of(first, member.worker_id))
        owned = _entries_of(first, victim.worker_id)
        _wait_until(lambda: client.status().index_entries >= owned, "the holder's blocks did not reach Redis")
        before = client.status().index_entries
        assert owned > 0
        started_s = time.monotonic()
        ray.kill(victim.actor, no_restart=True)
        _wait_until(lambda: client.status().index_entries <= before - owned,
                    "the dead worker's entries stayed in the index", timeout_s=first.config.index_lease_s)
        assert time.monotonic() - started_s < first.config.index_lease_s


def _entries_of(stack, worker_id: str) -> int:
    """Blocks the worker holds per its own event buffer (what it published)."""
    batch = ray.get(next(h for h in stack.cluster.prefill if h.worker_id == worker_id).actor
                    .read_kv_events.remote(-1), timeout=10)
    return len(batch.snapshot)


def _wait_until(condition, message: str, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, message
        time.sleep(0.1)
