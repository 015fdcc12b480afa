"""Generate through a real router on loopback: exact tokens, concurrency, cancellation, deadlines,
bad fields, duplicate ids — and the workers' pools clean after each."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from splitserve_client.client import AsyncClient, Client, build_request
from splitserve_client.protocol import splitserve_v1_pb2_grpc as pb_grpc
from splitserve_client.sdk_types import SENT_AT_KEY, AlreadyExists, DeadlineExceeded, InvalidArgument, error_from_rpc
from tests.factories import TinySpec, hf_greedy_generate, hf_prompt_logprobs, random_prompts

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_streamed_greedy_tokens_equal_hf(router_stack, checkpoint):
    prompts = random_prompts(6, 3, 70, 512, seed=11)
    expected = hf_greedy_generate(checkpoint(TinySpec()), prompts, max_new_tokens=12)
    with Client(router_stack.target) as client:
        for prompt, want in zip(prompts, expected):
            chunks = list(client.generate_stream(prompt, **GREEDY))
            assert [t for c in chunks for t in c.token_ids] == want
            assert chunks[0].route is not None and chunks[0].route.policy == "cache_aware"
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
            assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    router_stack.check_workers_clean()


def test_text_prompt_streams_the_decoded_text(router_stack, checkpoint):
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(checkpoint(TinySpec()))
    with Client(router_stack.target) as client:
        completion = client.generate("The quick brown fox", **GREEDY)
        by_ids = client.generate(tokenizer.encode("The quick brown fox"), **GREEDY, return_text=True)
    assert completion.token_ids == by_ids.token_ids
    assert completion.text == by_ids.text == tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
    assert completion.usage.prompt_tokens == len(tokenizer.encode("The quick brown fox"))


def test_stop_strings_cut_the_streamed_text_before_them(router_stack):
    prompt = random_prompts(1, 10, 10, 512, seed=24)[0]
    options = dict(temperature=0.0, max_tokens=16, ignore_eos=True, return_text=True)
    with Client(router_stack.target) as client:
        full = client.generate(prompt, **options).text
        for start in range(1, len(full) - 2, 3):  # stops that begin inside a token's text, too
            stop = full[start:start + 2]
            chunks = list(client.generate_stream(prompt, stop=[stop], **options))
            assert chunks[-1].finish_reason == "stop"
            assert "".join(c.text for c in chunks) == full[:full.index(stop)], stop
            assert "".join(c.text for c in chunks[:-1]).find(stop) == -1


def test_64_concurrent_streams_each_equal_its_solo_output(router_stack):
    prompts = random_prompts(64, 2, 40, 512, seed=5)
    with Client(router_stack.target) as client:
        solo = [client.generate(p, **GREEDY).token_ids for p in prompts]

    async def all_at_once():
        async with AsyncClient(router_stack.target) as client:
            return await asyncio.gather(*(client.generate(p, **GREEDY) for p in prompts))

    together = asyncio.run(asyncio.wait_for(all_at_once(), 120))
    assert [c.token_ids for c in together] == solo
    router_stack.check_workers_clean()


def test_client_cancellation_mid_stream_frees_blocks_on_both_sides(router_stack):
    with Client(router_stack.target) as client:
        stream = client.generate_stream(list(range(10, 90)), temperature=0.0, max_tokens=400, ignore_eos=True)
        received = [next(stream), next(stream)]
        stream.close()  # cancels the call: the router aborts the request on the prefill and decode workers
        assert received[0].route is not None
        _wait_inflight_zero(client)
    router_stack.check_workers_clean()


def test_deadline_expiry_answers_deadline_exceeded_and_frees_blocks(router_stack):
    prefill = router_stack.cluster.prefill[0].actor
    import ray

    with Client(router_stack.target, max_retries=0) as client:
        ray.get(prefill.debug_set_step_delay.remote(1.0))  # the deadline passes during prefill
        try:
            with pytest.raises(DeadlineExceeded):
                client.generate(list(range(5, 60)), timeout_s=0.5, **GREEDY)
        finally:
            ray.get(prefill.debug_set_step_delay.remote(0.0))
        with pytest.raises(DeadlineExceeded):  # ... and during decode
            client.generate(list(range(5, 60)), timeout_s=0.6, temperature=0.0, max_tokens=450, ignore_eos=True)
        _wait_inflight_zero(client)
        assert client.generate([3, 4, 5], **GREEDY).finish_reason == "length"  # still serving
    router_stack.check_workers_clean()


@pytest.mark.parametrize("prompt, options, field", [
    ([], {}, "token_ids"),
    ([1, 2, 512], {}, "token_ids"),
    ([-1], {}, "token_ids"),
    (list(range(1, 100)) * 6, {}, "token_ids"),
    ("", {}, "text"),
    ([1, 2], {"temperature": -0.5}, "sampling.temperature"),
    ([1, 2], {"top_p": 0.0}, "sampling.top_p"),
    ([1, 2], {"top_k": 0}, "sampling.top_k"),
    ([1, 2], {"max_tokens": 0}, "sampling.max_tokens"),
    ([1, 2], {"max_tokens": 10**6}, "sampling.max_tokens"),
    ([1, 2], {"min_tokens": 20, "max_tokens": 10}, "sampling.min_tokens"),
    ([1, 2], {"stop": [""]}, "sampling.stop"),
    ([1, 2], {"stop_token_ids": [9999]}, "sampling.stop_token_ids"),
    ([1, 2], {"logit_bias": {9999: 1.0}}, "sampling.logit_bias"),
    ([1, 2], {"logit_bias": {5: -101.0}}, "sampling.logit_bias"),
    ([1, 2], {"logprobs": 21}, "sampling.logprobs"),
    ([1, 2], {"prompt_logprobs": -1}, "sampling.prompt_logprobs"),
    ([1, 2], {"seed": -3}, "sampling.seed"),
    ([1, 2], {"ttft_ms": -1.0}, "slo.ttft_ms"),
    ([1, 2], {"priority": 5000}, "priority"),
    ([1, 2], {"tenant": "t" * 200}, "tenant"),
    ([1, 2], {"request_id": "has space"}, "request_id"),
])
def test_each_bad_field_is_invalid_argument_naming_it(router_stack, prompt, options, field):
    with Client(router_stack.target) as client:
        with pytest.raises(InvalidArgument) as err:
            client.generate(prompt, **options)
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and err.value.field == field
        assert field in err.value.reason
        assert client.generate([1, 2, 3], **GREEDY).token_ids  # the next request is served as usual


def test_a_malformed_send_time_header_is_invalid_argument_naming_it(router_stack):
    with grpc.insecure_channel(router_stack.target) as channel:
        call = pb_grpc.RouterStub(channel).Generate(build_request([1, 2, 3], **GREEDY), timeout=30,
                                                    metadata=((SENT_AT_KEY, "soon"),))
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    error = error_from_rpc(err.value)
    assert isinstance(error, InvalidArgument) and error.field == f"metadata {SENT_AT_KEY}"
    with Client(router_stack.target) as client:  # the SDK stamps a valid one on every request
        assert client.generate([1, 2, 3], **GREEDY).token_ids


def test_prompt_over_the_limit_states_the_limit(router_stack):
    with Client(router_stack.target) as client:
        with pytest.raises(InvalidArgument, match="limit is 512 tokens"):
            client.generate([7] * 600)


def test_a_running_request_id_cannot_run_twice(router_stack):
    with Client(router_stack.target) as client:
        stream = client.generate_stream([5, 6, 7], request_id="dup-1", temperature=0.0, max_tokens=300,
                                        ignore_eos=True)
        next(stream)
        with pytest.raises(AlreadyExists) as err:
            client.generate([5, 6, 7], request_id="dup-1", **GREEDY)
        assert err.value.field == "request_id"
        stream.close()
        _wait_inflight_zero(client)
        assert client.generate([5, 6, 7], request_id="dup-1", **GREEDY).request_id == "dup-1"  # free again


def test_model_info_and_cluster_status(router_stack):
    with Client(router_stack.target) as client:
        info = client.model_info()
        client.generate(list(range(3, 40)), **GREEDY)
        status = client.status()
    assert (info.vocab_size, info.max_model_len, info.block_size, info.hash_spec) == (
        512, 512, 16, "blake2b-128/v1/u32le")
    assert info.has_tokenizer and info.model_identity.startswith("LlamaForCausalLM/")
    assert sorted(w["role"] for w in status.workers) == ["decode", "prefill"]
    assert all(w["healthy"] for w in status.workers)
    assert status.routing_policy == "cache_aware" and status.requests_total.get("ok", 0) >= 1
    assert status.prompt_tokens_total >= 37


def _wait_inflight_zero(client: Client, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while client.status().inflight_requests:
        assert time.monotonic() < deadline_s, "requests still in flight on the router"
        time.sleep(0.05)


def test_prompt_logprobs_come_with_the_first_chunk_and_ignore_the_prefix_cache(router_stack, checkpoint):
    model_dir = checkpoint(TinySpec())
    prompt = random_prompts(1, 40, 40, 512, seed=17)[0]
    reference = hf_prompt_logprobs(model_dir, prompt)
    with Client(router_stack.target) as client:
        client.generate(prompt, **GREEDY)  # caches the prompt's blocks on the prefill worker
        chunks = list(client.generate_stream(prompt, prompt_logprobs=2, **GREEDY))
        assert [t for c in chunks for t in c.token_ids] == hf_greedy_generate(model_dir, [prompt], 12)[0]
        assert chunks[0].route.cached_prompt_tokens == 0 and all(not c.prompt_logprobs for c in chunks[1:])
        scored = chunks[0].prompt_logprobs
        assert [entry.token_id for entry in scored] == prompt[1:]
        for p, entry in enumerate(scored):
            assert abs(entry.logprob - reference[p, prompt[p + 1]].item()) < 1e-4
            assert [t for t, _ in entry.top] == reference[p].topk(2).indices.tolist()
        assert client.generate(prompt, **GREEDY).route.cached_prompt_tokens > 0  # the cache still serves others
        whole = client.generate(prompt, prompt_logprobs=0, **GREEDY)
        assert len(whole.prompt_logprobs) == len(prompt) - 1 and all(not e.top for e in whole.prompt_logprobs)
    router_stack.check_workers_clean()


def test_a_finished_stream_says_how_long_the_cluster_took(router_stack):
    """The `splitserve-upstream-ms` trailer: the router's wait on the cluster for this very request, so
    a client can tell the router's share of its latency (positive, and less than what the client saw)."""
    from splitserve_client.sdk_types import UPSTREAM_MS_KEY

    with grpc.insecure_channel(router_stack.target) as channel:
        started_s = time.perf_counter()
        call = pb_grpc.RouterStub(channel).Generate(build_request([5, 6, 7], max_tokens=4, ignore_eos=True),
                                                    timeout=60)
        assert len([message for message in call]) >= 1
        seen_ms = (time.perf_counter() - started_s) * 1e3
        upstream_ms = float(dict(call.trailing_metadata())[UPSTREAM_MS_KEY])
    assert 0 < upstream_ms < seen_ms
