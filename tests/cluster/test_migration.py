"""No request lost (real Ray actors, real SIGKILLs): streams whose decode instance or prefill worker dies
under them migrate and finish token-for-token equal to a fault-free run — greedy against HF
transformers, seeded sampling against the colocated engine — with stop strings, logprobs and usage
right; past `migration_limit` a request fails UNAVAILABLE naming the cause; and a sustained overload
of 1 prefill + 1 decode with admission `always` fails nothing."""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import jsonschema
import pytest
import ray

from engine import SamplingParams
from engine.structured.spec import StructuredOutputSpec
from splitserve_client.client import Client
from splitserve_client.sdk_types import Unavailable
from tests.engine.test_structured_outputs import SCHEMA
from tests.factories import TinySpec, hf_greedy_generate, random_prompts
from tests.router.cleanliness import wait_workers_clean
from tests.router.conftest import router_config, start_router

MAX_TOKENS = 48
LEASE_S = 6.0  # a decode rank waiting on a prefill worker that died before its channel formed gives up then
STEP_DELAY_S = 0.03  # decode steps are slowed so that a kill lands mid-stream (the tiny model is fast)


def _sigkill(actor) -> None:
    try:
        ray.get(actor.debug_signal.remote(signal.SIGKILL), timeout=10)
    except ray.exceptions.RayActorError:
        pass


class Streams:
    """Runs each prompt as one streaming request on its own thread, recording tokens as they arrive."""

    def __init__(self, target: str, prompts, params: dict, tag: str = "s", max_retries: int = 3):
        self.tag, self.max_retries = tag, max_retries
        self.tokens = [[] for _ in prompts]
        self.texts, self.routes = [[] for _ in prompts], [None] * len(prompts)
        self.finals, self.errors = [None] * len(prompts), [None] * len(prompts)
        self.threads = [threading.Thread(target=self._run, args=(target, i, p, params), daemon=True)
                        for i, p in enumerate(prompts)]
        for thread in self.threads:
            thread.start()

    def _run(self, target, index, prompt, params) -> None:
        try:
            with Client(target, max_retries=self.max_retries) as client:
                for chunk in client.generate_stream(prompt, request_id=f"{self.tag}{index}", **params):
                    self.tokens[index].extend(chunk.token_ids)
                    self.texts[index].append(chunk.text)
                    self.routes[index] = self.routes[index] or chunk.route
                    if chunk.finish_reason:
                        self.finals[index] = chunk
        except Exception as err:  # asserted on by the tests
            self.errors[index] = err

    def wait_tokens(self, at_least: int, timeout_s: float = 60) -> None:
        deadline_s = time.monotonic() + timeout_s
        while min(len(t) for t in self.tokens) < at_least:
            assert time.monotonic() < deadline_s, [len(t) for t in self.tokens]
            time.sleep(0.02)

    def route_decode(self, index: int) -> str:
        return self.routes[index].decode_instance

    def join(self, timeout_s: float = 180) -> None:
        for thread in self.threads:
            thread.join(timeout_s)
        assert not any(t.is_alive() for t in self.threads), "a stream hung"


@pytest.fixture(scope="module")
def stack(ray_session, checkpoint):
    config = router_config()
    two = replace(config, prefill=replace(config.prefill, replicas=2), decode=replace(config.decode, replicas=2),
                  handoff_lease_s=LEASE_S)
    stack = start_router(checkpoint(TinySpec()), two)
    yield stack
    stack.stop()


def _membership(stack):
    return stack.server.service.cluster.membership


def _wait_full_strength(stack, timeout_s: float = 60, replicas: int = 2) -> None:
    """Until both pools are back to `replicas`, every decode instance stepping slowly (see STEP_DELAY_S)."""
    deadline_s = time.monotonic() + timeout_s
    while len(_membership(stack).prefill) < replicas or len(_membership(stack).decode) < replicas:
        assert time.monotonic() < deadline_s
        time.sleep(0.1)
    for decode in _membership(stack).decode:
        ray.get(decode.actor.debug_set_step_delay.remote(STEP_DELAY_S), timeout=10)


def test_greedy_streams_survive_a_decode_instance_being_killed(stack, checkpoint):
    model_dir = checkpoint(TinySpec())
    _wait_full_strength(stack)
    prompts = random_prompts(16, 10, 50, 512, seed=41)
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    streams = Streams(stack.target, prompts, greedy)
    streams.wait_tokens(4)
    _sigkill(_membership(stack).decode[0].actor)
    streams.join()
    assert streams.errors == [None] * len(prompts)
    assert streams.tokens == hf_greedy_generate(model_dir, prompts, MAX_TOKENS)
    assert sum(f.migrations for f in streams.finals) >= 1
    for final in streams.finals:  # usage counts every token once; logprobs came with every token
        assert final.usage.completion_tokens == MAX_TOKENS and final.finish_reason == "length"
    with Client(stack.target) as client:
        assert client.status().migrations_total.get("decode_lost", 0) >= 1
    _wait_full_strength(stack)
    stack.cluster.refresh()
    wait_workers_clean(stack.cluster)


def test_seeded_streams_survive_a_decode_kill_with_the_fault_free_tokens(stack, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    _wait_full_strength(stack)
    prompts = random_prompts(8, 10, 50, 512, seed=42)
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=300 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                             presence_penalty=0.3) for i in range(len(prompts))]
    expected = [list(o.token_ids) for o in make_llm(model_dir).generate(prompts, seeded, use_tqdm=False)]
    streams = [Streams(stack.target, [p], dict(temperature=0.9, top_p=0.95, seed=300 + i, max_tokens=MAX_TOKENS,
                                               ignore_eos=True, presence_penalty=0.3), tag=f"seeded{i}-")
               for i, p in enumerate(prompts)]
    for s in streams:
        s.wait_tokens(4)
    _sigkill(_membership(stack).decode[1].actor)
    for s in streams:
        s.join()
    assert [s.errors[0] for s in streams] == [None] * len(prompts)
    assert [s.tokens[0] for s in streams] == expected


def test_streams_survive_a_prefill_worker_killed_mid_hand_off(stack, checkpoint):
    model_dir = checkpoint(TinySpec())
    _wait_full_strength(stack)
    decodes = _membership(stack).decode
    for decode in decodes:  # every transfer stalls on the decode side: hand-offs are under way
        ray.get(decode.actor.debug_set_receive_delay.remote(3.0), timeout=10)
    prompts = random_prompts(6, 20, 60, 512, seed=43)
    streams = Streams(stack.target, prompts, dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    streams.wait_tokens(1)  # first tokens streamed; their KV is on the wire
    _sigkill(_membership(stack).prefill[0].actor)
    for decode in decodes:
        ray.get(decode.actor.debug_set_receive_delay.remote(0.0), timeout=10)
    streams.join()
    assert streams.errors == [None] * len(prompts)
    assert streams.tokens == hf_greedy_generate(model_dir, prompts, MAX_TOKENS)
    _wait_full_strength(stack)
    stack.cluster.refresh()
    wait_workers_clean(stack.cluster, timeout_s=LEASE_S + 10)


def test_stop_strings_stay_right_across_a_migration(stack, checkpoint):
    model_dir = checkpoint(TinySpec())
    _wait_full_strength(stack)
    prompt = random_prompts(1, 30, 30, 512, seed=44)[0]
    text = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, return_text=True)
    with Client(stack.target) as client:
        whole = client.generate(prompt, **text)
    stop = whole.text[len(whole.text) * 3 // 4:][:3]  # late in the output: the kill comes before it
    assert stop.strip(), whole.text
    with Client(stack.target) as client:
        expected = client.generate(prompt, stop=[stop], **text)
    assert expected.finish_reason == "stop" and len(expected.token_ids) > 4
    streams = Streams(stack.target, [prompt], dict(stop=[stop], **text))
    streams.wait_tokens(3)
    _sigkill(next(d for d in _membership(stack).decode if d.worker_id == streams.route_decode(0)).actor)
    streams.join()
    assert streams.errors == [None] and streams.finals[0].migrations == 1
    assert streams.tokens[0] == list(expected.token_ids) and streams.finals[0].finish_reason == "stop"
    assert "".join(streams.texts[0]) == expected.text and stop not in expected.text
    assert list(expected.token_ids) == hf_greedy_generate(model_dir, [prompt], MAX_TOKENS)[0][:len(expected.token_ids)]


def test_structured_output_streams_survive_a_decode_kill_with_the_fault_free_tokens(stack, checkpoint, make_llm):
    """The prefill worker the request migrates to replays the tokens streamed so far into a new grammar
    matcher: seeded JSON-schema outputs equal the colocated engine's and validate."""
    _wait_full_strength(stack)
    prompts = random_prompts(4, 10, 30, 512, seed=45)
    options = [dict(temperature=1.0, seed=500 + i, max_tokens=120, json_schema=SCHEMA, return_text=True)
               for i in range(len(prompts))]
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    seeded = [SamplingParams(temperature=1.0, seed=500 + i, max_tokens=120, structured_output=spec)
              for i in range(len(prompts))]
    expected = [list(o.outputs[0].token_ids) for o in make_llm(checkpoint(TinySpec())).generate(prompts, seeded,
                                                                                              use_tqdm=False)]
    streams = [Streams(stack.target, [p], options[i], tag=f"structured{i}-") for i, p in enumerate(prompts)]
    for s in streams:
        s.wait_tokens(4)
    _sigkill(_membership(stack).decode[0].actor)
    for s in streams:
        s.join()
    assert [s.errors[0] for s in streams] == [None] * len(prompts)
    assert [s.tokens[0] for s in streams] == expected
    assert sum(s.finals[0].migrations for s in streams) >= 1
    for s in streams:
        jsonschema.validate(json.loads("".join(s.texts[0])), SCHEMA)
    _wait_full_strength(stack)
    stack.cluster.refresh()
    wait_workers_clean(stack.cluster)


def test_streams_wait_out_every_worker_being_killed_at_once(stack, checkpoint):
    """Both pools empty at once (every worker SIGKILLed): streams under way and requests sent while no
    worker is left wait for the replacements and finish with HF's tokens; none is refused (an empty
    membership once made the router call every prompt too long for a pool of 0 blocks)."""
    model_dir = checkpoint(TinySpec())
    _wait_full_strength(stack)
    prompts = random_prompts(6, 10, 50, 512, seed=46)
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    streams = Streams(stack.target, prompts[:4], greedy)
    streams.wait_tokens(4)
    for member in _membership(stack).members:
        _sigkill(member.actor)
    deadline_s = time.monotonic() + 30
    while _membership(stack).members:  # the controller has dropped every dead worker
        assert time.monotonic() < deadline_s, [m.worker_id for m in _membership(stack).members]
        time.sleep(0.02)
    late = Streams(stack.target, prompts[4:], greedy, tag="late")
    streams.join()
    late.join()
    assert streams.errors + late.errors == [None] * len(prompts)
    assert streams.tokens + late.tokens == hf_greedy_generate(model_dir, prompts, MAX_TOKENS)
    assert sum(f.migrations for f in streams.finals) >= 1, [f.migrations for f in streams.finals]
    _wait_full_strength(stack)
    stack.cluster.refresh()
    wait_workers_clean(stack.cluster, timeout_s=LEASE_S + 10)


@pytest.fixture(scope="module")
def no_migrations(ray_session, checkpoint):
    """1 prefill + 1 decode with `migration_limit` 0; the prefill worker computes one request at a time,
    32 tokens a step (requests queue behind a long prompt)."""
    config = replace(router_config(migration_limit=0), handoff_lease_s=LEASE_S)
    config = replace(config, prefill=replace(config.prefill, max_num_seqs=1, max_num_batched_tokens=32))
    stack = start_router(checkpoint(TinySpec()), config)
    yield stack
    stack.stop()


def test_past_the_migration_limit_a_request_fails_naming_the_cause(no_migrations):
    stack = no_migrations
    _wait_full_strength(stack, replicas=1)
    streams = Streams(stack.target, [[5] * 20], dict(temperature=0.0, max_tokens=400, ignore_eos=True))
    streams.wait_tokens(3)
    victim = _membership(stack).decode[0]
    _sigkill(victim.actor)
    streams.join()
    assert isinstance(streams.errors[0], Unavailable)
    assert "decode instance" in str(streams.errors[0]) and "limit" in str(streams.errors[0])
    _wait_replaced(stack, victim)


def test_a_worker_lost_during_the_hand_off_does_not_count_toward_the_limit(no_migrations, checkpoint):
    """With migration_limit 0, the prefill worker is killed while the request's KV is on the wire: the
    request had run to its first token and no decode step, so it cannot have caused the death. It
    migrates anyway (waiting for the replacement) and finishes with HF's tokens."""
    model_dir, stack = checkpoint(TinySpec()), no_migrations
    _wait_full_strength(stack, replicas=1)
    decode = _membership(stack).decode[0]
    ray.get(decode.actor.debug_set_receive_delay.remote(3.0), timeout=10)
    prompts = random_prompts(1, 20, 60, 512, seed=47)
    streams = Streams(stack.target, prompts, dict(temperature=0.0, max_tokens=16, ignore_eos=True))
    streams.wait_tokens(1)  # the first token is out; its KV is on the wire
    _sigkill(_membership(stack).prefill[0].actor)
    ray.get(decode.actor.debug_set_receive_delay.remote(0.0), timeout=10)
    streams.join()
    assert streams.errors == [None] and streams.finals[0].migrations == 1
    assert streams.tokens == hf_greedy_generate(model_dir, prompts, 16)
    stack.cluster.refresh()
    wait_workers_clean(stack.cluster, timeout_s=LEASE_S + 10)


def test_a_prefill_worker_lost_while_a_request_waited_in_its_queue_does_not_count(no_migrations, checkpoint):
    """With migration_limit 0, the prefill worker is killed while computing a long prompt, a second
    request waiting in its queue: the request being computed fails at the limit (it may have caused the
    death); the waiting one cannot have, migrates to the replacement and finishes with HF's tokens. A
    client's retry of the failed request id then succeeds (it once met the cancelled first attempt's id
    on the decode instance, which refuses it for a lease)."""
    model_dir, stack = checkpoint(TinySpec()), no_migrations
    _wait_full_strength(stack, replicas=1)
    prefill = _membership(stack).prefill[0]
    ray.get(prefill.actor.debug_set_step_delay.remote(0.3), timeout=10)  # the long prompt: ~13 steps, 4 s
    params = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    long_prompt = random_prompts(1, 400, 400, 512, seed=48)
    computing = Streams(stack.target, long_prompt, params, tag="c", max_retries=0)  # the router's verdict
    _wait_load(prefill, lambda stats: stats.running == 1)
    prompts = random_prompts(1, 30, 60, 512, seed=49)
    waiting = Streams(stack.target, prompts, params, tag="w")
    _wait_load(prefill, lambda stats: stats.waiting == 1)  # a step left it waiting: the worker said so
    time.sleep(0.5)  # for the router to read it (the long prompt has seconds of steps left)
    _sigkill(prefill.actor)
    computing.join()
    waiting.join()
    error = computing.errors[0]
    assert isinstance(error, Unavailable) and "prefill worker" in str(error) and "the limit" in str(error)
    assert waiting.errors == [None] and waiting.finals[0].migrations == 1
    assert waiting.tokens == hf_greedy_generate(model_dir, prompts, 8)
    retried = Streams(stack.target, long_prompt, params, tag="c", max_retries=0)  # the same request id
    retried.join()
    assert retried.errors == [None] and retried.tokens == hf_greedy_generate(model_dir, long_prompt, 8)
    stack.cluster.refresh()
    wait_workers_clean(stack.cluster, timeout_s=LEASE_S + 10)


def test_hand_offs_to_a_decode_instance_that_died_before_its_channel_opened_fail_fast(no_migrations, checkpoint):
    """With migration_limit 0, a fresh decode instance (no KV channel yet) takes three reservations and
    stalls its first receive; it is killed while the prefill worker's sender waits for it to open the
    channel and two more hand-offs queue behind. The membership change ends that wait at once (not
    at the transport's connect timeout, once per queued hand-off: requests once hung for minutes),
    it counts as a lost decode instance, and every request migrates and finishes with HF's tokens."""
    model_dir, stack = checkpoint(TinySpec()), no_migrations
    _wait_full_strength(stack, replicas=1)
    old = _membership(stack).decode[0]
    _sigkill(old.actor)  # its replacement has no channel with any prefill worker yet
    fresh = _wait_replaced(stack, old)
    ray.get(fresh.actor.debug_set_receive_delay.remote(8.0), timeout=10)
    prompts = random_prompts(3, 20, 40, 512, seed=50)
    started_s = time.monotonic()
    streams = Streams(stack.target, prompts, {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True})
    streams.wait_tokens(1)  # every first token is out: one hand-off waits for the channel, two queue
    _sigkill(fresh.actor)
    replacement = _wait_replaced(stack, fresh)
    ray.get(replacement.actor.debug_set_step_delay.remote(STEP_DELAY_S), timeout=10)
    streams.join()
    assert streams.errors == [None] * 3 and all(f.migrations >= 1 for f in streams.finals)
    assert streams.tokens == hf_greedy_generate(model_dir, prompts, 8)
    assert time.monotonic() - started_s < 60  # not 30 s of connect timeout per hand-off
    stack.cluster.refresh()
    wait_workers_clean(stack.cluster, timeout_s=LEASE_S + 10)


def _wait_replaced(stack, victim, timeout_s: float = 60):
    """The member that replaced `victim` (same slot, a later epoch) once it serves."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        for member in _membership(stack).members:
            if member.worker_id == victim.worker_id and member.epoch > victim.epoch:
                return member
        assert time.monotonic() < deadline_s, f"{victim.worker_id} was not replaced"
        time.sleep(0.1)


def _wait_load(worker, condition, timeout_s: float = 30) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition(ray.get(worker.actor.stats.remote(), timeout=10)):
        assert time.monotonic() < deadline_s, "the worker's load never reached the expected state"
        time.sleep(0.05)


def test_overload_fails_no_request_with_admission_always(ray_session, checkpoint):
    """Several times what 1 prefill + 1 decode serve, all at once, with a decode pool that cannot hold
    them all: requests wait for room (prefill queue, decode reservations), none is refused or lost."""
    model_dir = checkpoint(TinySpec())
    config = router_config()
    tight = replace(config, decode=replace(config.decode, num_kv_blocks=40), handoff_lease_s=3.0)
    stack = start_router(model_dir, tight)
    prompts = random_prompts(48, 40, 120, 512, seed=45)
    try:
        with Client(stack.target, timeout_s=600) as client, ThreadPoolExecutor(48) as pool:
            results = list(pool.map(lambda p: client.generate(p, temperature=0.0, max_tokens=24, ignore_eos=True),
                                    prompts))
        assert [list(r.token_ids) for r in results] == hf_greedy_generate(model_dir, prompts, 24)
        with Client(stack.target) as client:
            assert set(client.status().requests_total) == {"ok"}
        wait_workers_clean(stack.cluster)
    finally:
        stack.stop()
