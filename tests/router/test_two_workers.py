"""A router over two prefill workers with bearer auth: auth on, prefix_hash affinity, cache_aware
prefix hits through the in-process index, and a worker dying mid-stream."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve_client.client import Client
from splitserve_client.sdk_types import Unauthenticated
from tests.factories import TinySpec, hf_greedy_generate
from tests.router.conftest import router_config, start_router

TOKEN = "s3cret-token"
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def secured(ray_session, checkpoint, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    config = router_config(policy="prefix_hash", auth_token_file=str(token_file))
    config = replace(config, prefill=replace(config.prefill, replicas=2))
    stack = start_router(checkpoint(TinySpec()), config)
    yield stack
    stack.stop()


def test_auth_rejects_missing_and_wrong_tokens_and_leaves_health_open(secured):
    for token in (None, "wrong"):
        with Client(secured.target, token=token) as client:
            with pytest.raises(Unauthenticated):
                client.generate([1, 2, 3], **GREEDY)
            with pytest.raises(Unauthenticated):
                client.model_info()
    with grpc.insecure_channel(secured.target) as channel:  # probes carry no token
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with Client(secured.target, token=TOKEN) as client:
        assert len(client.generate([1, 2, 3], **GREEDY).token_ids) == 8


def test_prefix_hash_sends_same_prefix_requests_to_the_same_worker(secured):
    shared = list(range(40, 80))  # 2.5 blocks: the policy keys on the first two
    with Client(secured.target, token=TOKEN) as client:
        routes = [client.generate(shared + [200 + i, 300 + i], **GREEDY).route for i in range(6)]
        spread = {client.generate([i] * 40, **GREEDY).route.prefill_worker for i in range(10, 30)}
    assert len({r.prefill_worker for r in routes}) == 1
    assert all(r.policy == "prefix_hash" for r in routes)
    assert all(r.cached_prompt_tokens == 32 for r in routes[1:])  # the worker's prefix cache served them
    assert len(spread) == 2  # other prefixes use both workers
    secured.check_workers_clean()


def test_cache_aware_routes_to_the_holder_from_worker_events(ray_session, checkpoint):
    config = router_config(policy="cache_aware", metrics_port=0)
    stack = start_router(checkpoint(TinySpec()), replace(config, prefill=replace(config.prefill, replicas=2,
                                                                                   metrics_port=0),
                                                         decode=replace(config.decode, metrics_port=0)))
    try:
        prefix = list(range(100, 164))  # 4 blocks
        with Client(stack.target) as client:
            first = client.generate(prefix + [1, 2], **GREEDY).route
            _wait_for_index(stack, prefix)
            later = [client.generate(prefix + [3 + i, 4], **GREEDY).route for i in range(4)]
            status = client.status()
        assert all(r.prefill_worker == first.prefill_worker for r in later)
        assert all(r.cached_prompt_tokens == 64 for r in later)
        assert status.index_entries >= 4 and status.cached_prompt_tokens_total >= 4 * 64
        _check_prometheus(stack.server.exporter.url, status)
        _check_worker_telemetry(stack, first.prefill_worker)
        stack.check_workers_clean()
    finally:
        stack.stop()


def test_a_worker_dying_under_a_request_moves_it_and_others_go_on(secured, checkpoint):
    """Its prefill worker dies while the request waits there: the router resumes it on the other worker
    (one migration, no error even with SDK retries off), and the cluster keeps serving."""
    decode = secured.cluster.decode[0].actor
    prefill = secured.cluster.prefill[0]
    with Client(secured.target, token=TOKEN, max_retries=0) as client:
        ray.get(prefill.actor.debug_set_step_delay.remote(30.0))  # requests on this worker wait in prefill
        victim_prompt = _prompt_routed_to(client, prefill.worker_id)
        stream = client.generate_stream(victim_prompt, **GREEDY)
        time.sleep(1.0)
        ray.kill(prefill.actor, no_restart=True)
        chunks = list(stream)
        assert chunks[-1].migrations == 1 and chunks[-1].finish_reason == "length"
        assert [t for c in chunks for t in c.token_ids] == hf_greedy_generate(checkpoint(TinySpec()), [victim_prompt],
                                                                              GREEDY["max_tokens"])[0]
        assert len(client.generate(victim_prompt, **GREEDY).token_ids) == GREEDY["max_tokens"]
    assert ray.get(decode.check_integrity.remote(), timeout=10)["num_sequences"] == 0


def _prompt_routed_to(client: Client, worker_id: str) -> list[int]:
    """A prompt prefix_hash maps to `worker_id` (found by asking a worker-free question: the ring)."""
    from policies.routing.prefix_hash import PrefixHashPolicy
    from policies.routing import RouteQuery, WorkerLoad
    from engine.block_hash import HashNamespace, hash_blocks
    import asyncio

    info = client.model_info()
    ns = HashNamespace(info.model_identity, info.block_size)
    workers = [WorkerLoad(w, 0, 0) for w in (worker_id, worker_id.replace("prefill-0", "prefill-1"))]
    for start in range(1, 200):
        tokens = [start] * 40
        q = RouteQuery(tuple(hash_blocks(ns, tokens)), 40, info.block_size, b"")
        if asyncio.run(PrefixHashPolicy().choose(q, workers)).worker_id == worker_id:
            return tokens
    raise AssertionError("no prompt maps to the worker")


def _wait_for_index(stack, prefix, timeout_s: float = 10.0) -> None:
    """Until the router's index (fed by worker events) knows the prefix's blocks."""
    from engine.block_hash import HashNamespace, hash_blocks

    info = stack.server.service.info
    hashes = hash_blocks(HashNamespace(info.model_identity, info.block_size), prefix)
    deadline_s = time.monotonic() + timeout_s
    while not stack.loop.call(stack.server.service.index.match(hashes)):
        assert time.monotonic() < deadline_s, "worker KV events did not reach the router's index"
        time.sleep(0.05)


def _check_prometheus(url: str, status) -> None:
    """The router's Prometheus endpoint shows the same live figures as GetClusterStatus."""
    from common.metrics_http import scrape

    samples = scrape(url)
    model = {key: value for (_, labels) in samples for key, value in labels}["model_name"]  # every series has it
    value = lambda name, **labels: samples[(name, tuple(sorted({**labels, "model_name": model}.items())))]  # noqa: E731
    assert value("splitserve_router_requests_total", outcome="ok") == status.requests_total["ok"] == 5
    assert value("splitserve_router_ttft_seconds_count", priority="normal") == 5
    assert value("splitserve_router_goodput_requests_total") == 5  # no SLO given: finishing meets it
    assert value("splitserve_router_cached_prompt_tokens_total") == status.cached_prompt_tokens_total
    assert value("splitserve_router_prompt_tokens_total") == status.prompt_tokens_total


def _check_worker_telemetry(stack, worker_id: str) -> None:
    """Workers report their recent steps (for the router's cost models) and export their own metrics."""
    from common.metrics_http import scrape

    handle = next(h for h in stack.cluster.prefill if h.worker_id == worker_id)
    stats = ray.get(handle.actor.stats.remote(), timeout=10)
    assert stats.steps and all(step.duration_s > 0 and step.num_tokens >= 1 for step in stats.steps)
    samples = scrape(f"http://127.0.0.1:{stats.metrics_port}/metrics")
    model = ("model_name", Path(stack.cluster.model_dir).name)  # every series carries the served model's name
    labels = (model, ("phase", "prefill"), ("role", "prefill"), ("worker", worker_id))
    assert samples[("splitserve_worker_steps_total", labels)] >= 5
    ident = (model, ("role", "prefill"), ("worker", worker_id))
    prompt = samples[("splitserve_worker_prompt_tokens_total", ident)]
    hits = samples[("splitserve_worker_prefix_cache_hit_tokens_total", ident)]
    assert prompt >= 5 * 66 and hits >= 4 * 64
    decode = ray.get(stack.cluster.decode[0].actor.stats.remote(), timeout=10)
    assert decode.steps and decode.metrics_port


def test_cache_aware_pulls_the_prefix_when_the_holder_is_busy(ray_session, checkpoint):
    """The holder is slow, so its queue makes the other worker cheaper; that worker pulls the prefix
    from the holder (it never computed it, yet its prompt tokens are served from cache) and the output
    equals HF transformers."""
    from concurrent.futures import ThreadPoolExecutor


    model_dir = checkpoint(TinySpec())
    config = router_config(policy="cache_aware", prefix_pull="always")
    stack = start_router(model_dir, replace(config, prefill=replace(config.prefill, replicas=2)))
    try:
        prefix = list(range(100, 164))  # 4 blocks
        prompts = [prefix + list(range(300 + 40 * i, 340 + 40 * i)) for i in range(4)]
        with Client(stack.target) as client:
            holder = client.generate(prefix + [7, 8], **GREEDY).route.prefill_worker
            _wait_for_index(stack, prefix)
            actor = next(h.actor for h in stack.cluster.prefill if h.worker_id == holder)
            ray.get(actor.debug_set_step_delay.remote(0.5), timeout=10)  # its queue stays long for a while
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda p: client.generate(p, **GREEDY), prompts))
            ray.get(actor.debug_set_step_delay.remote(0.0), timeout=10)
        # Every hand-off (and pull) fed the planner's transfer model: it knows the link before it pulls.
        assert stack.server.service.pull_planner.pull_cost.num_samples >= 1 + len(prompts)
        pulled = [r.route for r in results if r.route.prefill_worker != holder]
        assert pulled, [r.route for r in results]
        assert all(route.cached_prompt_tokens == 64 for route in pulled)
        assert [list(r.token_ids) for r in results] == hf_greedy_generate(model_dir, prompts, GREEDY["max_tokens"])
        stack.check_workers_clean()
    finally:
        stack.stop()
