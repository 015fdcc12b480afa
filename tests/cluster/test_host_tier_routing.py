"""A prefix one prefill worker's pool evicted into its host tier routes there (real Ray actors, the
router's in-process prefix index fed by the workers' KV events): the worker publishes what enters its
host tier, the index knows the prefix is a fetch away on that worker and nowhere else, `cache_aware`
prices the fetch below recomputing it, and the worker serves it from its host tier (its hit counter
counts the blocks) with greedy tokens equal to HF transformers."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import ray

from common.config import ClusterConfig, PoolConfig
from common.kv_store_config import KVStoreConfig
from common.messages import GenerateRequest
from engine import SamplingParams
from prefix_index import PrefixMatch
from router.request_keys import route_query
from splitserve_client.client import Client
from tests.cluster.test_kv_store import _generate, _members, _tier_stats
from tests.factories import NUM_SPECIAL_TOKENS, TinySpec, hf_greedy_generate
from tests.router.cleanliness import wait_workers_clean
from tests.router.conftest import router_config, start_router

pytestmark = pytest.mark.timeout(300)
BLOCK = 16
PREFIX_BLOCKS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SPEC = TinySpec()


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(NUM_SPECIAL_TOKENS, SPEC.vocab_size) for _ in range(n)]


@pytest.fixture(scope="module")
def host_tier_stack(ray_session, checkpoint, tmp_path_factory):
    """P2D1, no shared store: each prefill worker has a 40-block pool and a disk host tier (16 MiB)."""
    pool = PoolConfig(num_cpus=0.5, num_kv_blocks=40, threads=1, replicas=2)
    kv_store = KVStoreConfig(host_tier_bytes=16 << 20, host_tier_dir=str(tmp_path_factory.mktemp("tier")))
    config: ClusterConfig = replace(
        router_config(prefix_pull="never"),
        prefill=pool,
        decode=replace(pool, num_kv_blocks=256, replicas=1),
        block_size=BLOCK,
        kv_store=kv_store,
        ready_timeout_s=240.0,  # three Ray actors loading on a shared 2-core host
    )
    stack = start_router(checkpoint(SPEC), config)
    yield stack
    stack.stop()


def _index_match(stack, hashes) -> list[PrefixMatch]:
    return stack.loop.call(stack.server.service.index.match(hashes))


def test_a_prefix_in_one_workers_host_tier_routes_there_and_is_served_from_it(host_tier_stack, checkpoint):
    stack = host_tier_stack
    cluster, model_dir = _members(stack), checkpoint(SPEC)
    a, b = cluster.prefill[0], cluster.prefill[1]
    prompt = _tokens(PREFIX_BLOCKS * BLOCK, seed=1) + _tokens(4, seed=2)
    _generate(cluster, GenerateRequest("ht-first", tuple(prompt), GREEDY), 0)  # worker a computes it
    for i in range(6):  # 9 blocks each through a's 40-block pool: the prefix is evicted, its host tier keeps it
        _generate(cluster, GenerateRequest(f"ht-fill{i}", tuple(_tokens(8 * BLOCK + 3, 10 + i)), GREEDY), 0)
    again = prompt[:-4] + _tokens(6, seed=3)
    query = route_query(again, "", stack.server.service.info.model_identity, BLOCK)
    assert len(query.block_hashes) == PREFIX_BLOCKS
    deadline_s = time.monotonic() + 30  # the router pulls the workers' events; the writer writes asynchronously
    while (matches := _index_match(stack, query.block_hashes)) != [PrefixMatch(a.worker_id, 0, PREFIX_BLOCKS)]:
        assert time.monotonic() < deadline_s, matches
        time.sleep(0.1)
    levels = stack.loop.call(stack.server.service.index.holder_levels(query.block_hashes))
    assert list(levels.depths) == [] and list(levels.host_extended()) == matches  # no pool holds it

    before = _tier_stats([a, b])
    with Client(stack.target) as client:
        completion = client.generate(again, max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
    after = _tier_stats([a, b])
    assert completion.route is not None and completion.route.prefill_worker == a.worker_id
    assert completion.usage is not None and completion.usage.cached_prompt_tokens == PREFIX_BLOCKS * BLOCK
    assert after[0]["disk"]["hits"] - before[0]["disk"]["hits"] == PREFIX_BLOCKS  # served by a's host tier
    assert after[0]["worker"]["blocks_fetched"] - before[0]["worker"]["blocks_fetched"] == PREFIX_BLOCKS
    assert after[1]["worker"]["blocks_fetched"] == before[1]["worker"]["blocks_fetched"]
    assert list(completion.token_ids) == hf_greedy_generate(model_dir, [again], GREEDY.max_tokens)[0]
    # the fetch was timed: a's own host-tier reads are what the router prices its next fetch by
    reads = ray.get(a.actor.stats.remote(), timeout=30).store_reads
    assert reads is not None and reads.host_fetched_bytes > 0 and reads.host_fetch_s > 0
    wait_workers_clean(cluster)
