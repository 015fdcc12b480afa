"""The prefill worker's first-token callbacks over a real prefill-role engine: a migrated request (its
prompt plus the tokens it already streamed) whose prefix-cache hit reaches past its prompt gets its first
token, and the worker's metrics count the prefilled context (such a hit once raised in the engine loop's
callback and broke the worker); a request left waiting by a step is told so, and told again before the
step that starts it runs; one scheduled at once is told nothing."""
from __future__ import annotations

import asyncio

from common.messages import PrefillQueue
from common.worker_metrics import WorkerMetrics
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


def test_a_request_left_waiting_is_told_so_and_told_again_before_it_is_computed(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    engine = make_llm(model_dir, role="prefill", block_size=16, max_num_seqs=1, max_num_batched_tokens=32).engine
    waiters = FirstTokenWaiters(engine, WorkerMetrics(PREFILL["worker"], PREFILL["role"]))
    prompts = random_prompts(2, 70, 70, 512, seed=73)  # 3 steps each at 32 tokens a step, one at a time
    seen: list[tuple[int, str, object]] = []  # (step, request, marker or first token) in arrival order
    steps = [0]

    def on_scheduled(chunks):  # the hook runs before the step's model: record what was already said
        waiters.on_scheduled(chunks)
        seen.append((steps[0], "scheduled", tuple(c.seq.seq_id for c in chunks)))

    async def listen(request_id, waiter):
        async for change in waiters.queue_changes(request_id, waiter):
            seen.append((steps[0], request_id, change))
        result, _ = await waiter
        seen.append((steps[0], request_id, result.token_id))
        engine.release(request_id)

    execute = engine.execute

    def execute_logged(step_input):
        seen.append((steps[0], "model", None))
        return execute(step_input)

    async def run():
        engine.on_scheduled, engine.execute = on_scheduled, execute_logged
        listeners = []
        for index, prompt in enumerate(prompts):
            rid = f"r{index}"
            listeners.append(asyncio.ensure_future(listen(rid, waiters.expect(rid))))
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=8))
        while engine.has_unfinished():
            waiters.on_updates(engine.step())
            steps[0] += 1
            await asyncio.sleep(0.01)  # the markers reach the listeners between steps, as on an actor's loop
        await asyncio.wait_for(asyncio.gather(*listeners), 10)

    asyncio.run(run())
    # Markers are read between steps here: r1 waits after step 0 and is told after step 0 ran (read at 1);
    # step 3 is the first to schedule r1, whose hook sent "computing" before that step's model ran (read at 4).
    markers = [(step, rid, m) for step, rid, m in seen if isinstance(m, PrefillQueue)]
    assert markers == [(1, "r1", PrefillQueue("r1", True)), (4, "r1", PrefillQueue("r1", False))]
    step3 = [what for step, what, _ in seen if step == 3 and what in ("scheduled", "model")]
    assert step3 == ["scheduled", "model"]
    assert next(step for step, what, ids in seen if what == "scheduled" and "r1" in ids) == 3
    tokens = {rid: token for _, rid, token in seen if rid in ("r0", "r1") and isinstance(token, int)}
    assert [tokens["r0"], tokens["r1"]] == [t[0] for t in hf_greedy_generate(model_dir, prompts, 1)]


def test_a_pulled_request_answered_before_its_caller_reads_still_says_it_was_computed(checkpoint, make_llm):
    """The engine may finish a short prompt before the actor's loop starts reading its markers (seen
    in CI): the "being computed" marker must still come, before the first token."""
    model_dir = checkpoint(TinySpec())
    engine = make_llm(model_dir, role="prefill", block_size=16).engine
    waiters = FirstTokenWaiters(engine, WorkerMetrics(PREFILL["worker"], PREFILL["role"]))
    prompt = random_prompts(1, 20, 20, 512, seed=74)[0]

    async def run():
        said = [waiters.waiting_for_pull("p")]
        waiter = waiters.expect("p")
        engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=8))
        while engine.has_unfinished():  # answered on this thread before anyone reads
            waiters.on_updates(engine.step())
        said += [change async for change in waiters.queue_changes("p", waiter)]
        result, _ = await asyncio.wait_for(waiter, 10)
        engine.release("p")
        return said, result

    said, result = asyncio.run(run())
    assert said == [PrefillQueue("p", True), PrefillQueue("p", False)]
    assert result.token_id == hf_greedy_generate(model_dir, [prompt], 1)[0][0]
    assert "p" not in waiters._markers  # read once, then forgotten
