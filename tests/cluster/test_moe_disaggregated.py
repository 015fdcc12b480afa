"""Mixture-of-experts models served disaggregated on real Ray actors behind a real router, greedy tokens
equal to HF's on every path, every pool ending with all its blocks free:
- latent attention (DeepSeek-V3 shape): TP=1 prefill workers hand the latent KV over gloo to a TP=2
  decode instance whose experts are split across its ranks (expert parallel), whose ranks each hold
  the whole latent and attend over it absorbed (the default; each rank folds its heads'
  up-projections), and which speculates with n-gram drafts; prefix hits on a prefill worker; the
  latent blocks of a prefix pulled from the other prefill worker; a SIGKILLed decode instance
  mid-stream, the streams waiting for its replacement and finishing exact;
- grouped-query attention (Qwen3-MoE, 2 KV heads under 4 query heads): 1 prefill + 2 decode instances
  with n-gram speculation; the decode workers export tokens per expert; a decode instance SIGKILLed
  mid-stream, its streams migrating to the other.
One cluster per model, shared by its class's tests (a launch costs seconds of worker start-up);
TP-sharded experts run over real process groups in tests/decode_worker/test_tp_moe.py."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import ray

from common.config import PoolConfig
from common.messages import PrefixPull
from common.metrics_http import scrape
from tests.cluster.conftest import run
from tests.cluster.test_disaggregated import GREEDY, SMALL_POOL, _assert_clean, _generate_all
from tests.cluster.test_migration import Streams, _sigkill
from tests.cluster.test_prefix_pull import GREEDY as PULL_GREEDY
from tests.cluster.test_prefix_pull import _assert_clean as _wait_pools_clean
from tests.cluster.test_prefix_pull import _generate as _generate_on
from tests.cluster.test_prefix_pull import _request as _pull_request
from tests.factories import hf_greedy_generate, random_prompts
from tests.moe_factories import make_moe_checkpoint, moe_spec
from tests.router.conftest import router_config, start_router

MLA_SPEC = moe_spec("deepseek_v3", num_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                    topk_group=2, first_k_dense_replace=1, q_lora_rank=24, routed_scaling_factor=2.5)
GQA_SPEC = moe_spec("qwen3_moe", seed=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
MAX_TOKENS = 32
STEP_DELAY_S = 0.05  # decode steps are slowed so that a kill lands mid-stream (the tiny models are fast)
STREAM = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _stack(model_dir, decode: PoolConfig, prefill: PoolConfig = SMALL_POOL):
    config = router_config()
    return start_router(model_dir, replace(config, prefill=prefill, decode=decode, handoff_lease_s=6.0))


def _members(stack):
    return stack.server.service.cluster.membership


def _wait_decode(stack, replicas: int, timeout_s: float = 120.0) -> None:
    """Until `replicas` decode instances are members, each stepping slowly (see STEP_DELAY_S)."""
    deadline_s = time.monotonic() + timeout_s
    while len(_members(stack).decode) < replicas or not _members(stack).prefill:
        assert time.monotonic() < deadline_s, "the decode pool did not come back"
        time.sleep(0.1)
    for decode in _members(stack).decode:
        ray.get(decode.actor.debug_set_step_delay.remote(STEP_DELAY_S), timeout=10)


def _kill_mid_stream(stack, model_dir, prompts, tag: str) -> Streams:
    """Streams `prompts`, SIGKILLs the decode instance serving the first once tokens flow, and checks
    every stream finished with HF's tokens and at least one migrated."""
    streams = Streams(stack.target, prompts, STREAM, tag=tag)
    streams.wait_tokens(3, timeout_s=120)
    victim = streams.route_decode(0)
    _sigkill(next(d for d in _members(stack).decode if d.worker_id == victim).actor)
    streams.join(timeout_s=300)
    assert streams.errors == [None] * len(prompts)
    assert streams.tokens == hf_greedy_generate(model_dir, prompts, MAX_TOKENS)
    assert sum(f.migrations for f in streams.finals) >= 1
    return streams


class TestLatentAttentionMoE:
    @pytest.fixture(scope="class")
    def mla_stack(self, ray_session, tmp_path_factory):
        model_dir = make_moe_checkpoint(tmp_path_factory.mktemp("mla"), MLA_SPEC)
        decode = replace(SMALL_POOL, tp_size=2, expert_parallel=True, speculative_config=NGRAM)
        stack = _stack(model_dir, decode, prefill=replace(SMALL_POOL, replicas=2))
        yield stack, model_dir
        stack.stop()

    def test_hand_off_to_tp2_expert_parallel_absorbed_speculating_decode_equals_hf(self, mla_stack):
        stack, model_dir = mla_stack
        prompts = [p + p for p in random_prompts(5, 1, 25, 512, seed=61)]  # repeats: the drafts hit
        assert run(_generate_all(stack.cluster, prompts)) == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
        spec = ray.get(stack.cluster.decode[0].actor.stats.remote(), timeout=30).spec
        assert spec is not None and spec.draft_tokens > 0
        _assert_clean(stack.cluster)

    def test_prefix_hits_on_prefill_keep_output_exact(self, mla_stack):
        stack, model_dir = mla_stack
        system = random_prompts(1, 40, 40, 512, seed=62)[0]
        prompts = [system + p for p in random_prompts(3, 3, 20, 512, seed=63)]
        first = run(_generate_all(stack.cluster, prompts[:1], prefix="warm"))
        again = run(_generate_all(stack.cluster, prompts, prefix="hit"))
        expected = hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
        assert first == expected[:1] and again == expected
        _assert_clean(stack.cluster)

    def test_latent_prefix_pulled_from_a_peer_prefill_worker_equals_hf(self, mla_stack):
        """A peer pull moves the latent blocks (their bytes: layers x latent x fp32 per token), and the
        puller continues from them exactly."""
        stack, model_dir = mla_stack
        cluster = stack.cluster
        shared = random_prompts(1, 3 * 16, 3 * 16, 512, seed=67)[0]  # three 16-token blocks
        first, second = (shared + tail for tail in random_prompts(2, 5, 9, 512, seed=68))
        got_first, _ = run(_generate_on(cluster, _pull_request("mla-pull-a", first), 0))
        pull = PrefixPull(cluster.prefill[0].worker_id, 3)
        got_second, chunk = run(_generate_on(cluster, _pull_request("mla-pull-b", second, pull), 1))
        assert chunk.pull.num_blocks == 3 and chunk.pull.error is None, chunk.pull
        assert cluster.prefill[1].info.kv_bytes_per_token == MLA_SPEC.num_layers * (16 + 8) * 4
        assert chunk.pull.num_bytes == 3 * 16 * cluster.prefill[1].info.kv_bytes_per_token
        assert chunk.num_cached_tokens == 3 * 16
        assert [got_first, got_second] == hf_greedy_generate(model_dir, [first, second], PULL_GREEDY.max_tokens)
        _wait_pools_clean(cluster)

    def test_streams_survive_the_decode_instance_being_killed(self, mla_stack):
        stack, model_dir = mla_stack
        _wait_decode(stack, 1)
        _kill_mid_stream(stack, model_dir, random_prompts(4, 10, 40, 512, seed=64), tag="mla-kill")
        _wait_decode(stack, 1)
        stack.cluster.refresh()
        stack.check_workers_clean(timeout_s=20)


class TestGroupedQueryMoE:
    @pytest.fixture(scope="class")
    def gqa_stack(self, ray_session, tmp_path_factory):
        model_dir = make_moe_checkpoint(tmp_path_factory.mktemp("gqa-moe"), GQA_SPEC)
        stack = _stack(model_dir, replace(SMALL_POOL, replicas=2, speculative_config=NGRAM, metrics_port=0))
        yield stack, model_dir
        stack.stop()

    def test_hand_off_to_a_speculating_decode_instance_equals_hf(self, gqa_stack):
        stack, model_dir = gqa_stack
        prompts = [p + p for p in random_prompts(6, 1, 25, 512, seed=66)]
        assert run(_generate_all(stack.cluster, prompts)) == hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
        stats = [ray.get(d.actor.stats.remote(), timeout=30) for d in stack.cluster.decode]
        assert sum(s.spec.draft_tokens for s in stats if s.spec is not None) > 0
        # The load-balance metric: every decode step's tokens reached two experts in each MoE layer.
        routed = sum(value for s in stats for (name, _), value in scrape(f"http://127.0.0.1:{s.metrics_port}/metrics").items()
                     if name == "splitserve_worker_moe_expert_tokens_total")
        assert routed >= 2 * GQA_SPEC.num_layers * len(prompts) * (GREEDY.max_tokens - 1)
        _assert_clean(stack.cluster)

    def test_streams_migrate_off_a_killed_decode_instance_with_hf_tokens(self, gqa_stack):
        stack, model_dir = gqa_stack
        _wait_decode(stack, 2)
        prompts = [p + p[: len(p) // 2] for p in random_prompts(6, 10, 40, 512, seed=65)]
        _kill_mid_stream(stack, model_dir, prompts, tag="gqa-kill")
        _wait_decode(stack, 2)
        stack.cluster.refresh()
        stack.check_workers_clean(timeout_s=20)
