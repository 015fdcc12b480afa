"""The simulated router's cache_aware choice against a brute-force walk of every holder at its deepest
leading block (what the policy defines), on random fleets: queues, holdings, dead workers, ties."""

from __future__ import annotations

import random

import pytest

from sim.router import SimRouter
from engine.block_pool import BlockRemoved, BlockStored

BLOCK_TOKENS = 16


def _brute_force(router: SimRouter, keys: list[int], prompt_tokens: int) -> tuple[int, int] | None:
    """Every alive worker: its deepest run of leading blocks held; least (cost, -blocks, worker)."""
    alive = [w for w, ok in enumerate(router.queued.alive) if ok]
    if not alive:
        return None
    best = None
    for worker in alive:
        blocks = 0
        for key in keys:
            if worker not in router.index.holders.get(key, ()):
                break
            blocks += 1
        uncached = max(prompt_tokens - blocks * BLOCK_TOKENS, 1) if blocks else prompt_tokens
        candidate = (router.queued.values[worker] + uncached, -blocks, worker)
        best = candidate if best is None else min(best, candidate)
    _, neg_blocks, worker = best
    return worker, max(prompt_tokens + neg_blocks * BLOCK_TOKENS, 1)


@pytest.mark.parametrize("seed", range(40))
def test_cache_aware_choice_equals_the_brute_force_walk(seed):
    rng = random.Random(seed)
    workers = rng.choice([1, 2, 5, 40, 300])
    router = SimRouter("cache_aware", workers, 1, BLOCK_TOKENS)
    keys = list(range(rng.randint(1, 8)))
    for worker in range(workers):  # popular leading blocks: most workers hold the first, fewer the next
        held = [k for k in keys if rng.random() < 0.9 - 0.1 * k]
        router.index.on_event(worker)(BlockStored(tuple(held), None, ()))
        if rng.random() < 0.2:
            router.index.on_event(worker)(BlockRemoved(tuple(held[:1])))
        router.queued.add(worker, rng.choice([0, 0, 16, 32, 100, rng.randint(0, 500)]))
        if workers > 1 and rng.random() < 0.1:
            router.set_alive("prefill", worker, False)
    for _ in range(20):
        prompt = rng.choice([1, 8, 16, 40, len(keys) * BLOCK_TOKENS, 200])
        query = keys[: rng.randint(0, len(keys))]
        assert router.choose_prefill(query, prompt) == _brute_force(router, query, prompt)
        worker = rng.randrange(workers)
        router.queued.add(worker, rng.randint(0, 64))


@pytest.mark.parametrize("seed", range(30))
def test_cache_aware_costs_what_the_real_routers_policy_costs(seed):
    """Same holdings and queues: the simulated choice has the real `CacheAwarePolicy`'s cost and cached
    blocks (the last tie goes to the lower index here, to the prefix-hash ring there)."""
    import asyncio

    from common.kv_events import KVEventBatch
    from prefix_index.memory import InProcessPrefixIndex
    from engine.block_hash import HashNamespace, hash_blocks
    from policies.routing import RouteQuery, WorkerLoad
    from policies.routing.cache_aware import CacheAwarePolicy

    rng, block_size = random.Random(seed), 4
    namespace, workers = HashNamespace("model/sim", block_size), rng.randint(1, 6)
    prompt = list(range(seed, seed + rng.choice([4, 9, 20, 24])))
    hashes = hash_blocks(namespace, prompt)
    index, sim = InProcessPrefixIndex(lease_s=30), SimRouter("cache_aware", workers, 1, block_size)
    for worker in range(workers):
        held = hashes[: rng.randint(0, len(hashes))]
        if held:
            events = tuple((i + 1, BlockStored((h,), None, ())) for i, h in enumerate(held))
            asyncio.run(index.apply(KVEventBatch(f"w{worker}", 1, len(events), events)))
            sim.index.on_event(worker)(BlockStored(tuple(held), None, ()))
        sim.queued.add(worker, rng.choice([0, 0, 4, 8, rng.randint(0, 30)]))
    query = RouteQuery(tuple(hashes), len(prompt), block_size, repr(prompt).encode())
    loads = [WorkerLoad(f"w{w}", 0, sim.queued.values[w]) for w in range(workers)]
    real = asyncio.run(CacheAwarePolicy(index).choose(query, loads))
    real_queued = sim.queued.values[int(real.worker_id[1:])]
    worker, uncached = sim.choose_prefill(hashes, len(prompt))
    assert (sim.queued.values[worker] + uncached, uncached) == (
        real_queued + max(len(prompt) - real.expected_cached_blocks * block_size, 1),
        max(len(prompt) - real.expected_cached_blocks * block_size, 1),
    )
