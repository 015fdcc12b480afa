"""The policies' walks over holder levels and a LoadBook choose exactly what scoring every worker chooses.

Random fleets with many ties (few distinct queue lengths, shared prefixes of a few depths), hot prefixes
held by most of the fleet, and dead workers (still in the index, gone from the loads).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from common.kv_events import KVEventBatch
from common.messages import StoreReads
from engine.block_hash import HashNamespace, hash_blocks
from engine.block_pool import BlockStored
from kv_store.block_record import block_key
from kv_store.host_tier import MemoryTier
from policies.admission import PrefillCostModel
from policies.admission.cost_model import PrefillTimeFit, TransferTimeFit
from policies.routing import LoadBook, RouteQuery, WorkerLoad, make_policy
from policies.routing.base import least_loaded
from policies.routing.cache_aware import CacheAwarePolicy, ExhaustiveCacheAwarePolicy
from policies.store_fetch_cost import StoreFetchCost
from prefix_index.memory import InProcessPrefixIndex
from prefix_index.worker_slots import WorkerSlots
from sim.drive import run_now

NS = HashNamespace("model/fast", 4)


def store(index: InProcessPrefixIndex, worker_id: str, tokens: list[int]) -> None:
    hashes = hash_blocks(NS, tokens)
    events = tuple((i + 1, BlockStored((h,), None, ())) for i, h in enumerate(hashes))
    run_now(index.apply(KVEventBatch(worker_id, 1, len(events), events)))


def random_fleet(rng: random.Random, index: InProcessPrefixIndex) -> tuple[list[WorkerLoad], list[list[int]]]:
    size = rng.choice([1, 3, 8, 40, 120])
    ids = [f"w{i:03d}" for i in range(size)]
    base = rng.randrange(10**6)
    prompts = [[base + t for t in range(rng.choice([3, 8, 16, 40]))] for _ in range(4)]
    hot = rng.random() < 0.5
    for worker_id in ids:
        for prompt in prompts:
            chance = 0.9 if hot and prompt is prompts[0] else 0.3
            if rng.random() < chance:
                store(index, worker_id, prompt[: 4 * rng.randint(1, max(len(prompt) // 4, 1))])
    queues = rng.choice([[0], [0, 8], [0, 4, 8, 40], list(range(0, 400, 4))])
    loads = [WorkerLoad(w, rng.randint(0, 2), rng.choice(queues)) for w in ids]
    alive = [w for w in loads if rng.random() > 0.2] or loads[:1]
    return alive, prompts


@pytest.mark.parametrize("masks", [False, True], ids=["walked", "masked"])
@pytest.mark.parametrize("seed", range(40))
def test_cache_aware_walk_equals_scoring_every_worker(seed, masks):
    """`masked`: the index and the book share worker slots, so the policy searches with masks."""
    rng = random.Random(seed)
    slots = WorkerSlots() if masks else None
    index = InProcessPrefixIndex(lease_s=30, slots=slots)
    alive, prompts = random_fleet(rng, index)
    book = LoadBook(alive, slots)
    fast, exhaustive = CacheAwarePolicy(index), ExhaustiveCacheAwarePolicy(index)
    for prompt in [*prompts, [7, 7]]:
        cut = prompt[: rng.randint(1, len(prompt))]
        query = RouteQuery(tuple(hash_blocks(NS, cut)), len(cut), 4, repr(cut).encode())
        expected = run_now(exhaustive.choose(query, alive))
        assert run_now(fast.choose(query, book)) == expected
        assert run_now(fast.choose(query, alive)) == expected  # a plain list takes the same walk
        if masks:  # the book changes under the policy (bookings, a death), the masks follow
            victim = rng.choice(alive)
            book.set(victim._replace(queued_prompt_tokens=victim.queued_prompt_tokens + rng.choice([0, 4, 400])))
            alive = list(book)
            assert run_now(fast.choose(query, book)) == run_now(exhaustive.choose(query, alive))
    book.check_integrity()
    fast.check_integrity()
    run_now(index.check_integrity())
    if slots is not None:
        slots.check_integrity()


@pytest.mark.parametrize("seed", range(10))
def test_load_book_stays_in_load_order_through_updates(seed):
    rng = random.Random(seed)
    slots = WorkerSlots() if seed % 2 else None  # with slots the book keeps a mask per queue length too
    book, truth = LoadBook(slots=slots), {}
    for _ in range(400):
        worker_id = f"w{rng.randrange(30)}"
        if rng.random() < 0.15:
            book.remove(worker_id)
            truth.pop(worker_id, None)
        else:
            load = WorkerLoad(worker_id, rng.randint(0, 3), rng.choice([0, 4, 8, rng.randrange(100)]))
            book.set(load)
            truth[worker_id] = load
        if truth:
            assert book.least() == least_loaded(list(truth.values()))
            expected = sorted(truth.values(), key=lambda w: (w.queued_prompt_tokens, w.inflight_requests, w.worker_id))
            assert list(book.ascending()) == expected
            query = RouteQuery((), 1, 4, b"")
            assert run_now(make_policy("least_loaded").choose(query, book)).worker_id == book.least().worker_id
        assert sorted(book, key=lambda w: w.worker_id) == sorted(truth.values(), key=lambda w: w.worker_id)
        if slots is not None:
            by_queue: dict[int, set[str]] = {}
            for load in truth.values():
                by_queue.setdefault(load.queued_prompt_tokens, set()).add(load.worker_id)
            assert [(q, set(slots.owners_of(m))) for q, m in book.masks_ascending()] == sorted(by_queue.items())
            assert set(slots.owners_of(book.mask)) == set(truth)
    book.check_integrity()


@pytest.mark.parametrize("seed", range(10))
def test_prefix_hash_on_a_book_equals_on_a_list(seed):
    rng = random.Random(seed)
    loads = [WorkerLoad(f"w{i}", 0, rng.choice([0, 100, 5000, 20000])) for i in range(rng.choice([2, 9, 60]))]
    on_book, on_list = make_policy("prefix_hash"), make_policy("prefix_hash")
    book = LoadBook(loads)
    for n in range(30):
        tokens = [seed, n, n + 1, n + 2, n + 3, n + 4, n + 5, n + 6]
        query = RouteQuery(tuple(hash_blocks(NS, tokens)), 6000, 4, b"")
        assert run_now(on_book.choose(query, book)) == run_now(on_list.choose(query, loads))


@pytest.mark.parametrize("masks", [False, True], ids=["walked", "masked"])
def test_a_busy_holder_level_behind_many_idle_workers_is_listed_not_walked(masks):
    """40 workers hold 6 blocks and are busy; 160 idle ones hold the 2-block system prompt only: the walk
    in load order gives up on the 6-block level after LOAD_WALK_STEPS workers and lists it instead."""
    slots = WorkerSlots() if masks else None
    index = InProcessPrefixIndex(lease_s=30, slots=slots)
    prompt = list(range(40))
    loads = []
    for i in range(200):
        deep = i < 40
        store(index, f"w{i:03d}", prompt[: 24 if deep else 8])
        loads.append(WorkerLoad(f"w{i:03d}", 1, (20 + i % 3) if deep else 8 * (i % 5)))
    for cut in (40, 30, 24, 12):
        query = RouteQuery(tuple(hash_blocks(NS, prompt[:cut])), cut, 4, b"p")
        expected = run_now(ExhaustiveCacheAwarePolicy(index).choose(query, loads))
        assert run_now(CacheAwarePolicy(index).choose(query, LoadBook(loads, slots))) == expected
        assert expected.holder_blocks == min(6, cut // 4)


def store_location(rng: random.Random, prompts: list[list[int]], fetch_s_per_block: float, latency_s: float):
    """A shared store (a real host-memory tier) holding a random leading part of each prompt, priced with
    1e-4 s per prefill token."""
    tier, layout = MemoryTier(1 << 20), bytes(range(16))
    for prompt in prompts:
        hashes = hash_blocks(NS, prompt)[: rng.randint(0, len(prompt) // 4)]
        tier.put_many([(block_key(layout, h), b"record") for h in hashes])
    location = StoreFetchCost(
        tier,
        block_bytes=1000,
        prefill_cost=PrefillCostModel(prior=PrefillTimeFit(0.0, 1e-4, 0.0)),
        timeout_s=5.0,
        read_prior=TransferTimeFit(latency_s=latency_s, per_byte_s=fetch_s_per_block / 1000),
    )
    location.layout = layout
    return location


def compare_with_a_store(seed: int) -> list[int]:
    """Runs the walk and the exhaustive scoring on a random fleet with a store; the store blocks of the
    decisions."""
    rng = random.Random(seed)
    index = InProcessPrefixIndex(lease_s=30)
    alive, prompts = random_fleet(rng, index)
    # a block costs 4 tokens to compute: fetches from 0.5 to 6 tokens a block, 0 to 5 tokens of latency
    store = store_location(rng, prompts, rng.choice([5e-5, 1e-4, 3e-4, 6e-4]), rng.choice([0.0, 1e-4, 5e-4]))
    book = LoadBook(alive)
    fast = CacheAwarePolicy(index, store=store)
    exhaustive = ExhaustiveCacheAwarePolicy(index, store=store)
    fetched = []

    async def compare() -> None:  # on a real event loop: the store is asked on a thread
        for prompt in [*prompts, [7, 7]]:
            cut = prompt[: rng.randint(1, len(prompt))]
            query = RouteQuery(tuple(hash_blocks(NS, cut)), len(cut), 4, repr(cut).encode())
            expected = await exhaustive.choose(query, alive)
            assert await fast.choose(query, book) == expected
            assert await fast.choose(query, alive) == expected
            fetched.append(expected.store_blocks)

    asyncio.run(compare())
    assert fast.store_failures == exhaustive.store_failures == 0
    book.check_integrity()
    store.close()
    return fetched


@pytest.mark.parametrize("seeds", [range(20), range(20, 40)])
def test_cache_aware_walk_equals_scoring_every_worker_with_a_store(seeds):
    fetched = [blocks for seed in seeds for blocks in compare_with_a_store(seed)]
    assert any(fetched) and not all(fetched)  # the fleets were priced both ways: some fetch, some compute


@pytest.mark.parametrize(("fetch_s_per_block", "chosen", "fetched"), [(1e-4, "a", 6), (6e-4, "b", 0)])
def test_cache_aware_prices_a_store_fetch_against_recompute(fetch_s_per_block, chosen, fetched):
    """a holds 2 of the prompt's 10 blocks and queues nothing; b holds 8 and queues 20 tokens; the store
    holds 8. Without the store b wins (20 + 8 computed < 0 + 32). A fetch of a block at 1 token's time
    makes a cheaper (6 fetched + 8 computed = 14); at 6 tokens a block it costs more than computing."""
    index = InProcessPrefixIndex(lease_s=30)
    prompt = list(range(100, 140))
    store(index, "a", prompt[:8])
    store(index, "b", prompt[:32])
    loads = [WorkerLoad("a", 0, 0), WorkerLoad("b", 1, 20)]
    location = store_location(random.Random(0), [], fetch_s_per_block, 0.0)
    location.store.put_many([(block_key(location.layout, h), b"r") for h in hash_blocks(NS, prompt[:32])])
    query = RouteQuery(tuple(hash_blocks(NS, prompt)), len(prompt), 4, b"p")
    assert run_now(CacheAwarePolicy(index).choose(query, loads)).worker_id == "b"
    for policy in (CacheAwarePolicy(index, store=location), ExhaustiveCacheAwarePolicy(index, store=location)):
        decision = asyncio.run(policy.choose(query, LoadBook(loads)))
        assert (decision.worker_id, decision.store_blocks) == (chosen, fetched)
    location.close()


def test_store_fetch_price_follows_the_workers_measured_reads():
    """Workers report cumulative fetch bytes and seconds; the router fits latency + bytes / bandwidth from
    the increments and prices a fetch in prefill tokens by the prefill model's per-token time."""
    location = store_location(random.Random(0), [], 1e-4, 0.0)
    assert location.fetch_tokens(0) == 0 and location.fetch_tokens(3) == 3  # the prior: 1 token a block
    total_bytes, total_s = 0, 0.0
    for interval in range(12):
        moved = (interval % 4 + 1) * 1_000_000
        total_bytes, total_s = total_bytes + moved, total_s + 0.002 + moved * 1e-9  # 1 GB/s, 2 ms a fetch
        location.observe_stats(
            "p0", "prefill", 1, WorkerStatsLike(StoreReads(location.layout.hex(), total_bytes, total_s))
        )
    assert location.bandwidth_bytes_per_s == pytest.approx(1e9, rel=1e-3)
    # 10 blocks of 1000 bytes: 2 ms + 10 µs = 20.1 prefill tokens of 1e-4 s
    assert location.fetch_tokens(10) == 21
    location.close()


class WorkerStatsLike:
    def __init__(self, reads: StoreReads):
        self.store_reads = reads
