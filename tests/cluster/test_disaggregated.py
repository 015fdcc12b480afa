"""Disaggregated serving on real Ray actors with KV moving over torch.distributed (gloo): outputs equal
HF transformers and the colocated engine on every topology; worker death never hangs or leaks."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.client import ClusterClient, RequestFailed
from common.config import ClusterConfig, PoolConfig
from cluster.launcher import ClusterStartError, launch
from common.messages import GenerateRequest, PrefillResult
from engine import SamplingParams
from tests.cluster.conftest import run
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMALL_POOL = PoolConfig(num_cpus=0.5, num_kv_blocks=128, threads=1)


def _config(**overrides) -> ClusterConfig:
    values = dict(prefill=SMALL_POOL, decode=SMALL_POOL, ready_timeout_s=90.0)
    values.update(overrides)
    return ClusterConfig(**values)


async def _collect(client: ClusterClient, request: GenerateRequest, **route) -> list[int]:
    tokens: list[int] = []
    async for chunk in client.generate(request, **route):
        tokens += chunk.token_ids
    return tokens


async def _generate_all(cluster, prompts, params=GREEDY, prefix="r") -> list[list[int]]:
    client = ClusterClient(cluster)
    try:
        requests = [GenerateRequest(f"{prefix}{i}", tuple(p), params if isinstance(params, SamplingParams)
                                    else params[i]) for i, p in enumerate(prompts)]
        return list(await asyncio.gather(*(_collect(client, r) for r in requests)))
    finally:
        await client.close()


def _assert_clean(cluster) -> None:
    import ray

    reports = ray.get([h.actor.check_integrity.remote() for h in cluster.prefill]
                      + [d.actor.check_integrity.remote() for d in cluster.decode], timeout=30)
    for report in reports:
        assert report["num_free_blocks"] == report["num_blocks"], report
        assert report["num_sequences"] == 0, report


def _wait_clean(cluster, timeout_s: float) -> None:
    """`_assert_clean`, once pins released asynchronously (by senders, lease expiry) are back."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            _assert_clean(cluster)
            return
        except AssertionError:
            if time.monotonic() > deadline_s:
                raise
            time.sleep(0.2)


@pytest.fixture
def cluster_factory(ray_session):
    launched = []

    def make(model_dir, **overrides):
        cluster = launch(_config(**overrides), str(model_dir))
        launched.append(cluster)
        return cluster

    yield make
    for cluster in launched:
        cluster.shutdown()


@pytest.fixture(scope="module")
def one_by_one(ray_session, checkpoint):
    """One 1P1D cluster of the default config over TinySpec(), shared by the tests that leave it clean
    (a launch costs seconds of worker start-up)."""
    cluster = launch(_config(), str(checkpoint(TinySpec())))
    yield cluster
    cluster.shutdown()


@pytest.mark.parametrize("num_prefill, num_decode", [(1, 1), (2, 1), (1, 2)])
def test_disaggregated_greedy_equals_hf_and_colocated(num_prefill, num_decode, checkpoint, cluster_factory,
                                                      make_llm, request):
    model_dir = checkpoint(TinySpec(num_heads=4, num_kv_heads=2))
    prompts = random_prompts(6, 1, 70, 512, seed=61)
    if (num_prefill, num_decode) == (1, 1):
        cluster = request.getfixturevalue("one_by_one")
    else:
        cluster = cluster_factory(model_dir, prefill=PoolConfig(**{**SMALL_POOL.__dict__, "replicas": num_prefill}),
                                  decode=PoolConfig(**{**SMALL_POOL.__dict__, "replicas": num_decode}))
    got = run(_generate_all(cluster, prompts))
    assert got == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    colocated = [list(o.token_ids) for o in make_llm(model_dir).generate(prompts, GREEDY, use_tqdm=False)]
    assert got == colocated
    _assert_clean(cluster)


def test_prefix_hits_on_prefill_keep_output_exact_and_seeded_sampling_matches(checkpoint, one_by_one, make_llm):
    model_dir = checkpoint(TinySpec(num_heads=4, num_kv_heads=2))
    system = random_prompts(1, 40, 40, 512, seed=62)[0]
    prompts = [system + p for p in random_prompts(4, 3, 20, 512, seed=63)]
    cluster = one_by_one
    first = run(_generate_all(cluster, prompts[:1], prefix="warm"))
    again = run(_generate_all(cluster, prompts, prefix="hit"))
    expected = hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    assert first == expected[:1]
    assert again == expected
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    colocated = [list(o.token_ids) for o in make_llm(model_dir).generate(prompts, seeded, use_tqdm=False)]
    assert run(_generate_all(cluster, prompts, seeded, prefix="seeded")) == colocated
    _assert_clean(cluster)


def test_unplaceable_pools_fail_fast_with_a_clear_error(checkpoint, ray_session):
    config = _config(prefill=PoolConfig(num_cpus=64), ready_timeout_s=3.0)
    started_s = time.monotonic()
    with pytest.raises(ClusterStartError, match=r"ask for 64.5 CPUs.*CPU=8"):
        launch(config, str(checkpoint(TinySpec())))
    assert time.monotonic() - started_s < 30


def test_decode_killed_during_transfer_releases_prefill_pins(checkpoint, cluster_factory):
    import ray

    cluster = cluster_factory(checkpoint(TinySpec()), handoff_lease_s=3.0)
    decode = cluster.decode[0].actor
    ray.get(decode.debug_set_receive_delay.remote(30.0))  # the transfer stalls on the decode side

    async def scenario():
        client = ClusterClient(cluster)
        task = asyncio.ensure_future(_collect(client, GenerateRequest("victim", tuple(range(10, 60)), GREEDY)))
        await asyncio.sleep(1.5)  # first token sampled, KV hand-off under way
        ray.kill(decode, no_restart=True)
        with pytest.raises(RequestFailed) as err:
            await task
        await client.close()
        return err.value

    error = run(scenario(), timeout_s=60)
    assert error.unavailable
    deadline_s = time.monotonic() + 15
    while time.monotonic() < deadline_s:  # pins drop once the lease has passed, not later
        report = ray.get(cluster.prefill[0].actor.check_integrity.remote(), timeout=10)
        if report["num_free_blocks"] == report["num_blocks"] and report["num_sequences"] == 0:
            break
        time.sleep(0.5)
    assert report["num_free_blocks"] == report["num_blocks"] and report["num_sequences"] == 0


def test_prefill_killed_fails_requests_and_decode_frees_reservations(checkpoint, cluster_factory):
    import ray

    cluster = cluster_factory(checkpoint(TinySpec()), handoff_lease_s=3.0)
    prefill = cluster.prefill[0].actor
    ray.get(prefill.debug_set_step_delay.remote(30.0))  # requests sit in the prefill engine

    async def scenario():
        client = ClusterClient(cluster)
        tasks = [asyncio.ensure_future(_collect(client, GenerateRequest(f"p{i}", (5, 6, 7, 8 + i), GREEDY)))
                 for i in range(3)]
        await asyncio.sleep(1.0)
        ray.kill(prefill, no_restart=True)
        errors = await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        return errors

    errors = run(scenario(), timeout_s=60)
    assert all(isinstance(e, RequestFailed) and e.unavailable and "prefill" in e.reason for e in errors), errors
    report = ray.get(cluster.decode[0].actor.check_integrity.remote(), timeout=10)
    assert report["num_free_blocks"] == report["num_blocks"]


def test_reservation_without_transfer_expires_after_the_lease(checkpoint, cluster_factory):
    import ray

    cluster = cluster_factory(checkpoint(TinySpec()), handoff_lease_s=1.0)
    decode = cluster.decode[0].actor
    target = ray.get(decode.reserve.remote("orphan", 40, "tester"), timeout=10)
    assert len(target.block_ids) == 3
    time.sleep(1.0 + 2.5)  # lease + grace
    updates = ray.get(decode.poll.remote("tester", 0.5), timeout=10)
    assert [u.request_id for u in updates] == ["orphan"] and "lease" in updates[0].error
    deadline_s = time.monotonic() + 10
    while ray.get(decode.check_integrity.remote())["num_free_blocks"] != 128 and time.monotonic() < deadline_s:
        time.sleep(0.2)
    assert ray.get(decode.check_integrity.remote())["num_free_blocks"] == 128


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # GQA: one KV head per rank; MQA: the head replicated
def test_decode_tp2_from_prefill_tp1_equals_hf(num_kv_heads, checkpoint, cluster_factory):
    model_dir = checkpoint(TinySpec(num_heads=4, num_kv_heads=num_kv_heads))
    prompts = random_prompts(5, 2, 60, 512, seed=64)
    cluster = cluster_factory(model_dir, decode=PoolConfig(**{**SMALL_POOL.__dict__, "tp_size": 2}))
    import ray

    # The ranks run in their instance's STRICT_PACK group: every bundle's CPU is taken by its rank.
    (name,) = [t["name"] for t in ray.util.placement_group_table().values()
                if t["name"].startswith(f"{cluster.config.cluster_name}:") and t["state"] == "CREATED"]
    group = ray.util.get_placement_group(name)
    table = ray.util.placement_group_table(group)
    assert (table["strategy"], table["state"], len(table["bundles"])) == ("STRICT_PACK", "CREATED", 2)
    group_cpu = f"CPU_group_{group.id.hex()}"
    assert ray.cluster_resources()[group_cpu] == 2 * SMALL_POOL.num_cpus
    assert ray.available_resources().get(group_cpu, 0.0) == 0.0  # Ray lists none left as absent
    target = ray.get(cluster.decode[0].actor.reserve.remote("probe", 20, "tester"))
    assert [(r.kv_head_start, r.kv_head_end) for r in target.ranks] == (
        [(0, 1), (1, 2)] if num_kv_heads == 2 else [(0, 1), (0, 1)])
    ray.get(cluster.decode[0].actor.cancel.remote("probe"))
    assert run(_generate_all(cluster, prompts)) == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    _assert_clean(cluster)


def test_leaving_after_the_first_token_frees_both_sides_and_forgets_the_handoff(one_by_one):
    import ray

    cluster = one_by_one
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def leave_early():
        client = ClusterClient(cluster)
        stream = client.generate(GenerateRequest("leaver", tuple(range(10, 60)), params))
        first = await stream.__anext__()
        await stream.aclose()  # the caller goes away with the hand-off possibly still running
        await client.close()  # waits for the aborts to reach both workers
        return first

    assert len(run(leave_early()).token_ids) == 1
    deadline_s = time.monotonic() + 20
    while ray.get(cluster.prefill[0].actor.stats.remote(), timeout=10).in_flight:
        assert time.monotonic() < deadline_s, "the prefill worker kept the abandoned hand-off"
        time.sleep(0.1)
    _wait_clean(cluster, timeout_s=20)


def test_an_aborted_hand_off_ends_the_prefill_stream_without_an_error(one_by_one):
    """The caller aborts while the KV is on its way (a slow receiver keeps it there): the worker's
    stream ends after the first token, not with an exception that nobody would read (Ray logs those
    as unhandled errors), and both sides let go of the request."""
    import ray

    cluster = one_by_one
    prefill, decode = cluster.prefill[0], cluster.decode[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    request = GenerateRequest("quiet-abort", tuple(range(10, 60)), params)
    ray.get(decode.actor.debug_set_receive_delay.remote(1.0), timeout=10)
    try:
        items = []
        for ref in prefill.actor.prefill.options(num_returns="streaming").remote(request, decode, "tester"):
            items.append(ray.get(ref, timeout=30))  # the old stream raised HandoffFailed("... was aborted") here
            if isinstance(items[-1], PrefillResult):
                ray.get(prefill.actor.abort.remote(request.request_id), timeout=30)
        assert isinstance(items[-1], PrefillResult) and items[-1].handoff
    finally:
        ray.get(decode.actor.debug_set_receive_delay.remote(0.0), timeout=10)
        ray.get(decode.actor.cancel.remote(request.request_id), timeout=30)
    _wait_clean(cluster, timeout_s=20)


def test_hand_offs_abandoned_in_a_burst_leave_the_channel_usable(checkpoint, cluster_factory):
    """Callers leave right after their first token while hand-offs queue behind each other on the
    sender and leases run out mid-queue; the requests after that must still be served exactly."""
    model_dir = checkpoint(TinySpec())
    cluster = cluster_factory(model_dir, handoff_lease_s=1.5)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    prompts = random_prompts(24, 300, 400, 512, seed=77)
    decode = cluster.decode[0].actor

    async def burst_then_serve():
        await decode.debug_set_receive_delay.remote(0.3)  # each transfer takes a while: the sender queues
        client = ClusterClient(cluster)

        async def leave_after_first(i: int, prompt: list[int]) -> None:
            stream = client.generate(GenerateRequest(f"burst-{i}", tuple(prompt), params))
            try:
                await stream.__anext__()
            except RequestFailed:  # a lease that ran out before the first token: fine here
                pass
            finally:
                await stream.aclose()

        await asyncio.gather(*(leave_after_first(i, p) for i, p in enumerate(prompts)))
        await client.close()
        await decode.debug_set_receive_delay.remote(0.0)
        return await _generate_all(cluster, prompts[:4], GREEDY, prefix="after")

    got = run(burst_then_serve(), timeout_s=240)
    assert got == hf_greedy_generate(model_dir, prompts[:4], GREEDY.max_tokens)
    _wait_clean(cluster, timeout_s=30)
