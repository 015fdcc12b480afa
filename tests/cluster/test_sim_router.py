"""The simulated router's cache_aware choice against a brute-force walk of every holder at its deepest
leading block (what the policy defines), on random fleets: queues, holdings, dead workers, ties."""

from __future__ import annotations

import random

import pytest

from cluster.sim.router import SimRouter
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
