"""Peer-to-peer prefix reuse on real Ray actors over gloo: a prefill worker pulls cached KV blocks from
the worker holding them, the output still equals HF transformers, the pulled blocks become local
prefix-cache entries, and every way a pull can fail falls back to computing the prompt."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray

from cluster.client import ClusterClient
from common.config import ClusterConfig, PoolConfig
from cluster.launcher import launch
from common.messages import GenerateRequest, PrefillQueue, PrefillResult, PrefixPull
from engine import SamplingParams
from tests.cluster.conftest import run
from tests.factories import NUM_SPECIAL_TOKENS, TinySpec, hf_greedy_generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
POOL = PoolConfig(num_cpus=0.5, num_kv_blocks=128, threads=1)
BLOCK = 16
SPEC = TinySpec(num_heads=4, num_kv_heads=2)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(NUM_SPECIAL_TOKENS, SPEC.vocab_size) for _ in range(n)]


def _launch(model_dir, **overrides):
    values = dict(prefill=PoolConfig(**{**POOL.__dict__, "replicas": 2}), decode=POOL, ready_timeout_s=90.0,
                  block_size=BLOCK)
    values.update(overrides)
    return launch(ClusterConfig(**values), str(model_dir))


@pytest.fixture(scope="module")
def pull_cluster(ray_session, checkpoint):
    model_dir = checkpoint(SPEC)
    cluster = _launch(model_dir)
    yield cluster, model_dir
    cluster.shutdown()


async def _generate(cluster, request: GenerateRequest, prefill_index: int):
    """(tokens, first chunk) of one request sent to prefill worker `prefill_index`."""
    client = ClusterClient(cluster)
    try:
        tokens, first = [], None
        async for chunk in client.generate(request, prefill=cluster.prefill[prefill_index]):
            first = first or chunk
            tokens += chunk.token_ids
        return tokens, first
    finally:
        await client.close()


def _assert_clean(cluster) -> None:
    deadline_s = time.monotonic() + 20
    while True:  # a holder's pins are released by its sender thread just after the requester moved on
        reports = ray.get([h.actor.check_integrity.remote() for h in cluster.prefill]
                          + [d.actor.check_integrity.remote() for d in cluster.decode], timeout=30)
        if all(r["num_free_blocks"] == r["num_blocks"] and r["num_sequences"] == 0 for r in reports):
            return
        assert time.monotonic() < deadline_s, reports
        time.sleep(0.1)


def _request(rid: str, tokens: list[int], pull: PrefixPull | None = None, tenant: str = "") -> GenerateRequest:
    return GenerateRequest(rid, tuple(tokens), GREEDY, tenant=tenant, prefix_pull=pull)


def test_pulled_prefix_gives_hf_output_and_becomes_a_local_hit(pull_cluster):
    cluster, model_dir = pull_cluster
    holder_id = cluster.prefill[0].worker_id
    shared = _tokens(5 * BLOCK, seed=1)
    first, second, third = shared + _tokens(7, 2), shared + _tokens(13, 3), shared + _tokens(9, 4)
    got_first, _ = run(_generate(cluster, _request("pull-a", first), 0))
    got_second, chunk = run(_generate(cluster, _request("pull-b", second, PrefixPull(holder_id, 5)), 1))
    assert chunk.pull.num_blocks == 5 and chunk.pull.error is None, chunk.pull
    assert chunk.pull.num_bytes == 5 * BLOCK * cluster.prefill[1].info.kv_bytes_per_token
    assert chunk.num_cached_tokens == 5 * BLOCK
    # The pulled blocks are prefix-cache entries of worker 1 now: a later prompt hits them locally.
    got_third, chunk = run(_generate(cluster, _request("pull-c", third), 1))
    assert chunk.pull is None and chunk.num_cached_tokens == 5 * BLOCK
    assert [got_first, got_second, got_third] == hf_greedy_generate(model_dir, [first, second, third],
                                                                   GREEDY.max_tokens)
    _assert_clean(cluster)


def test_pull_takes_only_what_is_missing_and_what_the_holder_has(pull_cluster):
    cluster, model_dir = pull_cluster
    holder_id = cluster.prefill[0].worker_id
    base = _tokens(3 * BLOCK, seed=10)
    longer = base + _tokens(2 * BLOCK, seed=11)
    run(_generate(cluster, _request("part-a", base + _tokens(5, 12)), 1))  # worker 1 holds 3 blocks
    run(_generate(cluster, _request("part-b", longer + _tokens(5, 13)), 0))  # worker 0 holds all 5
    prompt = longer + _tokens(20, 14)
    got, chunk = run(_generate(cluster, _request("part-c", prompt, PrefixPull(holder_id, 5)), 1))
    assert chunk.pull.num_blocks == 2 and chunk.num_cached_tokens == 5 * BLOCK  # 3 local + 2 pulled
    # Asked for more than the holder has: it sends the blocks it holds, the rest is computed.
    other = _tokens(2 * BLOCK, seed=15)
    run(_generate(cluster, _request("part-d", other + _tokens(3, 16)), 0))
    prompt_two = other + _tokens(3 * BLOCK + 4, seed=17)
    got_two, chunk = run(_generate(cluster, _request("part-e", prompt_two, PrefixPull(holder_id, 5)), 1))
    assert chunk.pull.num_blocks == 2 and chunk.num_cached_tokens == 2 * BLOCK
    assert [got, got_two] == hf_greedy_generate(model_dir, [prompt, prompt_two], GREEDY.max_tokens)
    _assert_clean(cluster)


def test_failed_pulls_fall_back_to_computing(pull_cluster):
    cluster, model_dir = pull_cluster
    holder_id = cluster.prefill[0].worker_id
    shared = _tokens(4 * BLOCK, seed=20)
    run(_generate(cluster, _request("fail-a", shared + _tokens(3, 21), tenant="tenant-a"), 0))
    prompts = [shared + _tokens(6, 22), shared + _tokens(6, 23), _tokens(70, 24)]
    cases = [("fail-b", prompts[0], PrefixPull(holder_id, 4), "tenant-b"),  # another tenant: no hit there
             ("fail-c", prompts[1], PrefixPull(f"{holder_id}-gone", 4), ""),  # no such worker
             ("fail-d", prompts[2], PrefixPull(holder_id, 4), "")]  # the holder never had it
    outputs = []
    for rid, prompt, pull, tenant in cases:
        tokens, chunk = run(_generate(cluster, _request(rid, prompt, pull, tenant), 1))
        assert chunk.pull.num_blocks == 0 and chunk.pull.error, chunk.pull
        assert chunk.num_cached_tokens == 0
        outputs.append(tokens)
    assert outputs == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    _assert_clean(cluster)


def test_a_request_pulling_its_prefix_is_marked_waiting_first(pull_cluster):
    """Before the pull starts the worker's stream says the request waits: should the worker die during
    the pull, the request was not being computed, and the router does not count the death toward its
    migration limit (tests/cluster/test_migration_counting.py). Once a step starts it, the stream says
    so, so that a death while it is computed does count."""
    cluster, _ = pull_cluster
    shared = _tokens(4 * BLOCK, seed=60)
    run(_generate(cluster, _request("mark-a", shared + _tokens(3, 61)), 0))
    request = _request("mark-b", shared + _tokens(5, 62), PrefixPull(cluster.prefill[0].worker_id, 4))
    decode = cluster.decode[0]
    stream = cluster.prefill[1].actor.prefill.options(num_returns="streaming").remote(request, decode, "tester")
    items = [ray.get(ref, timeout=30) for ref in stream]
    try:
        # waiting while it pulls, then told it is being computed (a death from then on counts)
        assert items[:2] == [PrefillQueue("mark-b", waiting=True), PrefillQueue("mark-b", waiting=False)]
        first = next(item for item in items if isinstance(item, PrefillResult))
        assert first.pull is not None  # the pull ran (its success is other tests' business)
    finally:
        ray.get(decode.actor.cancel.remote("mark-b"), timeout=30)
    _assert_clean(cluster)


def test_two_workers_pulling_from_each_other_at_once(pull_cluster):
    cluster, model_dir = pull_cluster
    ids = [h.worker_id for h in cluster.prefill]
    prefixes = [_tokens(4 * BLOCK, seed=30), _tokens(4 * BLOCK, seed=31)]
    for index, prefix in enumerate(prefixes):
        run(_generate(cluster, _request(f"cross-seed-{index}", prefix + _tokens(2, 32 + index)), index))
    prompts = [prefixes[1] + _tokens(5, 40), prefixes[0] + _tokens(5, 41)]  # each pulls the other's prefix

    async def both():
        return await asyncio.gather(
            _generate(cluster, _request("cross-0", prompts[0], PrefixPull(ids[1], 4)), 0),
            _generate(cluster, _request("cross-1", prompts[1], PrefixPull(ids[0], 4)), 1))

    results = run(both())
    assert [chunk.pull.num_blocks for _, chunk in results] == [4, 4]
    assert [tokens for tokens, _ in results] == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    _assert_clean(cluster)


def test_a_pull_that_times_out_is_abandoned_without_leaking(ray_session, checkpoint):
    model_dir = checkpoint(SPEC)
    cluster = _launch(model_dir, prefix_pull_timeout_s=0.5)
    try:
        holder = cluster.prefill[0]
        shared = _tokens(4 * BLOCK, seed=50)
        run(_generate(cluster, _request("slow-a", shared + _tokens(3, 51)), 0))
        ray.get(holder.actor.debug_set_step_delay.remote(2.0), timeout=10)
        prompt = shared + _tokens(8, 52)

        async def scenario():
            # A request keeps the holder's engine stepping slowly, so pinning the prefix waits past the timeout.
            busy = asyncio.ensure_future(_generate(cluster, _request("slow-busy", _tokens(40, 53)), 0))
            await asyncio.sleep(0.2)
            result = await _generate(cluster, _request("slow-b", prompt, PrefixPull(holder.worker_id, 4)), 1)
            await busy
            return result

        tokens, chunk = run(scenario())
        assert chunk.pull.num_blocks == 0 and "Timeout" in chunk.pull.error, chunk.pull
        assert tokens == hf_greedy_generate(model_dir, [prompt], GREEDY.max_tokens)[0]
        ray.get(holder.actor.debug_set_step_delay.remote(0.0), timeout=10)
        _assert_clean(cluster)
    finally:
        cluster.shutdown()
