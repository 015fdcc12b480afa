"""The routing-policy contract, run against every policy, plus each policy's exact behaviour."""
from __future__ import annotations

import asyncio

import pytest

from common.kv_events import KVEventBatch
from prefix_index.memory import InProcessPrefixIndex
from engine.block_hash import HashNamespace, hash_blocks
from engine.block_pool import BlockStored
from policies.routing import POLICIES, NoWorkersError, RouteDecision, RouteQuery, WorkerLoad, make_policy
from policies.routing.cache_aware import CacheAwarePolicy
from policies.routing.prefix_hash import PrefixHashPolicy

NS = HashNamespace("model/abc", 4)


def query(tokens, block_size: int = 4) -> RouteQuery:
    return RouteQuery(tuple(hash_blocks(NS, tokens)), len(tokens), block_size, repr(tokens).encode())


def loads(*ids, inflight=0, queued=0):
    return [WorkerLoad(w, inflight, queued) for w in ids]


def choose(policy, q, workers):
    return asyncio.run(policy.choose(q, workers))


async def stored(index, worker_id: str, tokens, epoch: int = 1) -> None:
    hashes = hash_blocks(NS, tokens)
    events = tuple((i + 1, BlockStored((h,), None, ())) for i, h in enumerate(hashes))
    await index.apply(KVEventBatch(worker_id, epoch, len(events), events))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_choice_is_a_member_deterministic_and_empty_raises(name):
    workers = loads("w-a", "w-b", "w-c")
    prompts = [list(range(s, s + 13)) for s in range(20)]
    first = make_policy(name, InProcessPrefixIndex(lease_s=30))
    second = make_policy(name, InProcessPrefixIndex(lease_s=30))
    picks = [choose(first, query(p), workers).worker_id for p in prompts]
    assert set(picks) <= {"w-a", "w-b", "w-c"}
    assert picks == [choose(second, query(p), workers).worker_id for p in prompts]  # same inputs, same picks
    with pytest.raises(NoWorkersError):
        choose(first, query(prompts[0]), [])
    first.check_integrity()


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match="cache_aware.*prefix_hash.*round_robin"):
        make_policy("random")


def test_round_robin_cycles_in_id_order():
    policy = make_policy("round_robin")
    picks = [choose(policy, query([1, 2, 3]), loads("b", "a", "c")).worker_id for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_prefix_hash_sends_same_prefix_to_same_worker_whatever_follows():
    policy = PrefixHashPolicy(prefix_blocks=2)
    workers = loads(*(f"w{i}" for i in range(4)))
    shared = list(range(100, 108))  # two full blocks of 4
    picks = {choose(policy, query(shared + [s, s + 1, s + 2]), workers).worker_id for s in range(30)}
    assert len(picks) == 1
    spread = {choose(policy, query([s] * 8), workers).worker_id for s in range(40)}
    assert len(spread) == 4  # different prefixes spread over the workers


def test_prefix_hash_moves_only_about_one_nth_of_keys_when_a_worker_joins_or_leaves():
    policy = PrefixHashPolicy(prefix_blocks=1)
    prompts = [[s, s + 1, s + 2, s + 3] for s in range(0, 8000, 4)]
    before = [choose(policy, query(p), loads("w0", "w1", "w2", "w3")).worker_id for p in prompts]
    joined = [choose(policy, query(p), loads("w0", "w1", "w2", "w3", "w4")).worker_id for p in prompts]
    moved = [(a, b) for a, b in zip(before, joined) if a != b]
    assert all(b == "w4" for _, b in moved)  # keys only move to the newcomer
    assert 0.10 < len(moved) / len(prompts) < 0.30  # ~1/5 of them
    left = [choose(policy, query(p), loads("w0", "w1", "w3")).worker_id for p in prompts]
    moved_left = [(a, b) for a, b in zip(before, left) if a != b]
    assert all(a == "w2" for a, _ in moved_left)  # only the leaver's keys move
    assert len(moved_left) == before.count("w2")
    policy.check_integrity()


def test_prefix_hash_bounds_load_and_spills_a_hot_prefix_in_ring_order():
    ids = ("w0", "w1", "w2", "w3")
    q = query(list(range(100, 112)))  # 12 tokens
    first, second, third, _ = PrefixHashPolicy().preference(q, loads(*ids))

    def pick(load_factor=1.25, **queued):
        policy = PrefixHashPolicy(prefix_blocks=2, load_factor=load_factor, slack_tokens=4096)
        return choose(policy, q, [WorkerLoad(w, 0, queued.get(w, 0)) for w in ids]).worker_id
    assert pick() == first  # idle: the owner
    assert pick(**{first: 4000}) == first  # under the slack: affinity kept whatever the others hold
    assert pick(**dict.fromkeys(ids, 8000)) == first  # balanced: bound 1.25 · 32012 / 4 = 10003.75
    # bound max(1.25 · 10012 / 4, 4096) = 4096: the owner's 10000 are over → the next in ring order
    assert pick(**{first: 10000}) == second
    assert pick(**{first: 20000, second: 9000}) == second  # bound 1.25 · 29012 / 4 = 9066.25
    assert pick(**{first: 20000, second: 12000}) == third  # bound 1.25 · 32012 / 4 = 10003.75
    assert pick(None, **{first: 10**6}) == first  # load_factor None: the pure ring
    for bad in (dict(load_factor=0.9), dict(slack_tokens=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PrefixHashPolicy(**bad)


def test_cache_aware_cost_is_queued_plus_uncached_tokens():
    index = InProcessPrefixIndex(lease_s=30)
    prompt = list(range(1, 41))  # 40 tokens = 10 blocks of 4
    asyncio.run(stored(index, "holder", prompt[:32]))  # holds 8 blocks = 32 tokens
    policy = CacheAwarePolicy(index)
    # holder: 0 queued + 8 uncached = 8; idle: 0 + 40 = 40 → the holder, with its 8 blocks
    decision = choose(policy, query(prompt), [WorkerLoad("holder", 3, 0), WorkerLoad("idle", 0, 0)])
    assert decision == ("holder", 8, "holder", 8, 0, 0)
    # holder: 31 + 8 = 39 < 40 → still the holder; at 33 queued: 41 > 40 → the idle worker
    assert choose(policy, query(prompt), [WorkerLoad("holder", 1, 31), WorkerLoad("idle", 0, 0)]).worker_id == "holder"
    assert choose(policy, query(prompt), [WorkerLoad("holder", 1, 33), WorkerLoad("idle", 0, 0)]) == ("idle", 0, "holder", 8, 0, 0)
    # equal cost: the longer cached prefix wins the tie
    assert choose(policy, query(prompt), [WorkerLoad("holder", 0, 32), WorkerLoad("idle", 0, 0)]) == ("holder", 8, "holder", 8, 0, 0)


def test_cache_aware_falls_back_to_prefix_hash_when_the_index_fails():
    from prefix_index import IndexNamespace, RedisPrefixIndex
    from tests.redis_server import _free_port

    # a real Redis index whose server is not there: every lookup fails fast with PrefixIndexUnavailable
    unreachable = RedisPrefixIndex(f"redis://127.0.0.1:{_free_port()}/0", IndexNamespace("model/abc", 4),
                                   lease_s=30, timeout_s=0.2)
    policy = CacheAwarePolicy(unreachable)
    fallback = PrefixHashPolicy()
    workers = loads("a", "b", "c")
    for s in range(10):
        q = query(list(range(s, s + 12)))
        assert choose(policy, q, workers) == choose(fallback, q, workers)
    assert policy.index_failures == 10


def test_cache_aware_cold_prefixes_follow_the_ring_so_routers_agree():
    workers = loads("a", "b", "c", "d")
    ring = PrefixHashPolicy()
    for s in range(30):
        q = query(list(range(s, s + 12)))
        # two routers (two policy objects over two empty indexes) pick the ring's owner on an idle cluster
        picks = {choose(CacheAwarePolicy(InProcessPrefixIndex(lease_s=30)), q, workers) for _ in range(2)}
        assert picks == {choose(ring, q, workers)}
        preference = ring.preference(q, workers)
        assert sorted(preference) == ["a", "b", "c", "d"] and preference[0] == choose(ring, q, workers).worker_id


def test_least_loaded_takes_the_fewest_queued_tokens_then_requests_then_the_smallest_id():
    policy = make_policy("least_loaded", InProcessPrefixIndex(lease_s=30))
    q = query(list(range(12)))
    fewest_tokens = [WorkerLoad("a", 0, 50), WorkerLoad("b", 9, 40), WorkerLoad("c", 1, 45)]
    assert choose(policy, q, fewest_tokens) == ("b", 0, None, 0, 0, 0)
    fewest_requests = [WorkerLoad("a", 2, 40), WorkerLoad("c", 1, 40), WorkerLoad("b", 1, 40)]
    assert choose(policy, q, fewest_requests) == ("b", 0, None, 0, 0, 0)
    assert choose(policy, q, [WorkerLoad("b", 0, 0), WorkerLoad("a", 0, 0)]).worker_id == "a"


@pytest.mark.parametrize("seed", range(30))
def test_cache_aware_equals_ranking_every_worker_in_ring_order(seed):
    """The choice and the holder are the least (cost, -cached blocks, ring rank) and (-cached blocks, ring
    rank) over all workers, as defined, however the policy avoids ranking them all."""
    import random

    rng = random.Random(seed)
    index = InProcessPrefixIndex(lease_s=30)
    prompt = list(range(seed * 100, seed * 100 + rng.choice([3, 4, 9, 20, 24])))
    ids = [f"w{i}" for i in range(rng.choice([1, 2, 5, 40]))]
    for worker_id in ids:
        held = rng.randint(0, len(prompt) // 4)
        if held and rng.random() < 0.7:
            asyncio.run(stored(index, worker_id, prompt[: held * 4]))
    workers = [WorkerLoad(w, rng.randint(0, 3), rng.choice([0, 0, 4, 8, rng.randint(0, 40)])) for w in ids]
    q = query(prompt)
    cached = {m.worker_id: m.num_blocks for m in asyncio.run(index.match(q.block_hashes))}
    rank = {w: i for i, w in enumerate(PrefixHashPolicy().preference(q, workers))}

    def cost(w):
        return w.queued_prompt_tokens + max(len(prompt) - cached.get(w.worker_id, 0) * 4, 1)

    best = min(workers, key=lambda w: (cost(w), -cached.get(w.worker_id, 0), rank[w.worker_id]))
    holder = min(workers, key=lambda w: (-cached.get(w.worker_id, 0), rank[w.worker_id]))
    expected = RouteDecision(best.worker_id, cached.get(best.worker_id, 0))
    if cached.get(holder.worker_id, 0):
        expected = expected._replace(holder_id=holder.worker_id, holder_blocks=cached[holder.worker_id])
    assert choose(CacheAwarePolicy(index), q, workers) == expected
