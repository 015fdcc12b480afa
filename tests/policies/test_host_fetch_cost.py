"""`cache_aware` prices a fetch from a worker's own host tier (policies/routing/host_tier_choice.py) at
that worker's measured host-tier read bandwidth (policies/host_fetch_cost.py): the worker whose host tier
holds the prompt wins while fetching costs less than recomputing, and loses once its own reports say
the fetch is slow. The fast walk and the exhaustive reference decide alike."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.config import ClusterConfig, ConfigError
from common.kv_events import KVEventBatch
from common.kv_store_config import KVStoreConfig
from common.messages import StoreReads
from engine.block_hash import HashNamespace, hash_blocks
from engine.block_pool import MEDIUM_HOST, BlockStored
from policies.admission import PrefillCostModel
from policies.admission.cost_model import PrefillTimeFit, TransferCostModel, TransferTimeFit
from policies.host_fetch_cost import HOST_READ_PRIOR, HostFetchCost, host_read_prior
from policies.routing import RouteQuery, WorkerLoad
from policies.routing.cache_aware import CacheAwarePolicy, ExhaustiveCacheAwarePolicy
from prefix_index.memory import InProcessPrefixIndex

NS = HashNamespace("model/host", 4)
PROMPT = list(range(300, 340))  # 10 blocks of 4; 9 usable (the last token is always computed)
HASHES = hash_blocks(NS, PROMPT)
QUERY = RouteQuery(tuple(HASHES), len(PROMPT), 4, b"p")
BLOCK_BYTES = 1000


class Stats:  # what a prefill worker's `WorkerStats` carries for this listener
    def __init__(self, reads: StoreReads):
        self.store_reads = reads



def pool(*hashes) -> BlockStored:
    return BlockStored(tuple(hashes), None, ())


def host(*hashes) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), medium=MEDIUM_HOST)


def cost_model() -> tuple[HostFetchCost, PrefillCostModel]:
    prefill = PrefillCostModel(prior=PrefillTimeFit(0.0, 1e-3, 0.0))  # 1 ms a token
    return HostFetchCost(BLOCK_BYTES, prefill), prefill


def choose(policy_type, index, location, loads):
    policy = policy_type(index)
    policy.locate_host_tier(location)
    return asyncio.run(policy.choose(QUERY, loads))


@pytest.mark.parametrize("policy_type", [CacheAwarePolicy, ExhaustiveCacheAwarePolicy])
def test_a_host_tier_holder_wins_while_fetching_is_cheaper_and_loses_when_its_bandwidth_says_so(policy_type):
    index = InProcessPrefixIndex(lease_s=30)
    asyncio.run(index.apply(KVEventBatch("a", 1, 1, ((1, host(*HASHES)),))))  # a's pool evicted them all
    loads = [WorkerLoad("a", 1, 10), WorkerLoad("b", 0, 0)]
    location, prefill = cost_model()
    # the prior: 1 ms + 0.5 ns a byte, so 9 blocks (9 kB) cost 2 tokens; a: 10 queued + 2 + 4 computed = 16,
    # b: 40 computed
    assert location.fetch_tokens("a", 9) == 2
    decision = choose(policy_type, index, location, loads)
    assert (decision.worker_id, decision.expected_cached_blocks, decision.host_blocks) == ("a", 0, 9)
    # a reports slow host-tier fetches: 10 µs a byte, so the 9 blocks cost 90 tokens, more than computing
    total_bytes, total_s = 0, 0.0
    for k in range(1, 11):
        total_bytes, total_s = total_bytes + k * BLOCK_BYTES, total_s + k * BLOCK_BYTES * 1e-5
        location.observe_stats("a", "prefill", 1, Stats(StoreReads("00", total_bytes, total_s, total_bytes, total_s)))
    assert location.bandwidth_bytes_per_s("a") == pytest.approx(1e5)
    assert location.fetch_tokens("a", 9) == 90
    assert location.bandwidth_bytes_per_s("b") == HOST_READ_PRIOR.bandwidth_bytes_per_s  # b's own: not seen
    decision = choose(policy_type, index, location, loads)
    assert (decision.worker_id, decision.expected_cached_blocks, decision.host_blocks) == ("b", 0, 0)


@pytest.mark.parametrize("policy_type", [CacheAwarePolicy, ExhaustiveCacheAwarePolicy])
def test_the_pool_prefix_then_the_host_tier_and_ties_keep_the_fetch_free_choice(policy_type):
    index = InProcessPrefixIndex(lease_s=30)
    asyncio.run(index.apply(KVEventBatch("a", 1, 2, ((1, pool(*HASHES[:3])), (2, host(*HASHES[:6]))))))
    asyncio.run(index.apply(KVEventBatch("b", 1, 1, ((1, pool(*HASHES[:5])),))))
    location, _ = cost_model()
    # a: 3 in its pool, 3 more from its host tier (2 tokens), 16 computed = 18; b: 20 computed; c: 40
    loads = [WorkerLoad("a", 0, 0), WorkerLoad("b", 0, 0), WorkerLoad("c", 0, 0)]
    decision = choose(policy_type, index, location, loads)
    assert (decision.worker_id, decision.expected_cached_blocks, decision.host_blocks) == ("a", 3, 3)
    assert (decision.holder_id, decision.holder_blocks) == ("b", 5)  # the deepest pool, for a pull
    # a queues 2 tokens: 20 each, a tie, which the worker that fetches nothing takes
    loads = [WorkerLoad("a", 0, 2), WorkerLoad("b", 0, 0), WorkerLoad("c", 0, 0)]
    decision = choose(policy_type, index, location, loads)
    assert (decision.worker_id, decision.host_blocks) == ("b", 0)
    # no host-tier location (a router without host tiers configured): the pools alone decide
    decision = asyncio.run(policy_type(index).choose(QUERY, [WorkerLoad("a", 0, 0), WorkerLoad("b", 0, 0)]))
    assert (decision.worker_id, decision.host_blocks) == ("b", 0)
    # a worker not routable now is not chosen for its host tier
    decision = choose(policy_type, index, location, [WorkerLoad("c", 0, 0)])
    assert (decision.worker_id, decision.host_blocks) == ("c", 0)


def test_on_random_fleets_the_choice_is_the_least_cost_over_every_workers_options():
    """Each worker's cost by definition: its queue plus the least of computing what its pool lacks and
    fetching its host-tier run (at its own price) then computing the rest; the walk and the exhaustive
    reference both reach it, and ties keep the fetch-free choice."""
    rng = random.Random(5)
    location, _ = cost_model()
    prices = {f"w{i}": rng.choice([1e-6, 1e-5, 1e-4]) for i in range(12)}  # seconds a byte: fast to slow
    for worker_id, per_byte_s in prices.items():
        location._models[worker_id] = TransferCostModel(prior=TransferTimeFit(0.001, per_byte_s))
    for _ in range(60):
        index = InProcessPrefixIndex(lease_s=30)
        pools, hosts = {}, {}
        for worker_id in prices:
            pools[worker_id] = n = rng.choice([0, 0, 1, 3, 5])
            hosts[worker_id] = reach = rng.choice([n, n, rng.randint(n, 10)])
            events = ((1, pool(*HASHES[:n])), (2, host(*HASHES[:reach])))
            asyncio.run(index.apply(KVEventBatch(worker_id, 1, 2, events)))
        loads = [WorkerLoad(w, 0, rng.randrange(0, 40, 4)) for w in prices]

        def own(blocks: int) -> int:
            return max(len(PROMPT) - blocks * 4, 1)

        def cost(load: WorkerLoad) -> int:
            n, fetched = pools[load.worker_id], min(hosts[load.worker_id], 9) - pools[load.worker_id]
            with_fetch = location.fetch_tokens(load.worker_id, fetched) + own(n + fetched) if fetched > 0 else own(n)
            return load.queued_prompt_tokens + min(own(n), with_fetch)

        least = min(cost(load) for load in loads)
        for policy_type in (CacheAwarePolicy, ExhaustiveCacheAwarePolicy):
            decision = choose(policy_type, index, location, loads)
            chosen = next(load for load in loads if load.worker_id == decision.worker_id)
            assert cost(chosen) == least, policy_type
            fetch_free = min(load.queued_prompt_tokens + own(pools[load.worker_id]) for load in loads)
            assert (decision.host_blocks > 0) == (least < fetch_free)


def test_the_prior_bandwidth_is_the_configured_one_and_a_bad_value_names_the_key():
    """`kv_store.host_read_prior_bytes_per_s` prices the host tier of a worker that reported no fetch yet."""
    prefill = PrefillCostModel(prior=PrefillTimeFit(0.0, 1e-3, 0.0))  # 1 ms a token
    slow = HostFetchCost(BLOCK_BYTES, prefill, host_read_prior(KVStoreConfig(host_read_prior_bytes_per_s=1e5)))
    assert slow.bandwidth_bytes_per_s("a") == pytest.approx(1e5)
    assert slow.fetch_tokens("a", 9) in (91, 92)  # 1 ms + 9 kB at 100 kB/s = 91 ms, rounded up
    assert host_read_prior(KVStoreConfig()) == HOST_READ_PRIOR  # the default: 2 GB/s
    config = ClusterConfig.from_dict({"kv_store": {"host_tier_bytes": 1 << 20, "host_read_prior_bytes_per_s": 5e8}})
    assert host_read_prior(config.kv_store).bandwidth_bytes_per_s == pytest.approx(5e8)
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match=r"kv_store\.host_read_prior_bytes_per_s: must be a finite number > 0"):
            ClusterConfig.from_dict({"kv_store": {"host_read_prior_bytes_per_s": bad}})
