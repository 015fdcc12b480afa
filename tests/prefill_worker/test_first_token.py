"""The prefill worker's first-token callback over a real prefill-role engine: a migrated request (its
prompt plus the tokens it already streamed) whose prefix-cache hit reaches past its prompt gets its first
token, and the worker's metrics count the prefilled context (such a hit once raised in the engine loop's
callback and broke the worker)."""
from __future__ import annotations

import asyncio

from cluster.worker_metrics import WorkerMetrics
from engine import SamplingParams
from prefill_worker.first_token import FirstTokenWaiters
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

PREFILL = {"worker": "prefill-0", "role": "prefill"}


async def _first_token(engine, waiters, request_id, prompt, streamed):
    waiter = waiters.expect(request_id)
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=64), output_token_ids=streamed)
    while engine.has_unfinished():
        waiters.on_updates(engine.step())
    result, blocks = await asyncio.wait_for(waiter, 10)
    assert blocks is not None and result.handoff
    engine.release(request_id)
    return result


def test_a_migrated_request_cached_past_its_prompt_gets_its_first_token(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    engine = make_llm(model_dir, role="prefill", block_size=16).engine
    metrics = WorkerMetrics(PREFILL["worker"], PREFILL["role"])
    waiters = FirstTokenWaiters(engine, metrics)
    prompt = random_prompts(1, 79, 79, 512, seed=71)[0]
    streamed = random_prompts(1, 8, 8, 512, seed=72)[0]

    async def run():
        first = await _first_token(engine, waiters, "r", prompt, streamed[:5])  # 84 tokens: 5 full blocks
        again = await _first_token(engine, waiters, "r~m1", prompt, streamed)  # 87 tokens, 80 of them cached
        return first, again

    first, again = asyncio.run(run())
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 80)
    assert [first.token_id, again.token_id] == [  # the cached path is exact
        hf_greedy_generate(model_dir, [prompt + streamed[:5]], 1)[0][0],
        hf_greedy_generate(model_dir, [prompt + streamed], 1)[0][0],
    ]
    read = metrics.registry.get_sample_value
    assert read("splitserve_worker_prompt_tokens_total", PREFILL) == 84 + 87
    assert read("splitserve_worker_prefix_cache_hit_tokens_total", PREFILL) == 80
