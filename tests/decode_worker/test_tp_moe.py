"""Mixture-of-experts decode instances over real processes: at TP=2 greedy tokens equal HF's with the
experts split across the ranks (expert parallel) and with every expert's features split (TP-sharded
experts), for a GQA MoE model and an MLA one (heads split, latent replicated on each rank; decode
attention absorbed, the default, and expanded).

The ranks run in the long-lived spawned agents of tests/decode_worker/test_tp_group.py, on the same
real gloo groups and step broadcast a decode instance uses.
"""
from __future__ import annotations

import pytest

from decode_worker.tp_group import StepFollower, TensorParallelEngine, build_follower_runner, create_tp_group
from engine.config import EngineConfig
from tests.decode_worker.test_tp_group import HOST, _generate, _new_instance

GROUP_TIMEOUT_S = 30.0
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from tests.moe_factories import make_moe_checkpoint

    built: dict[str, object] = {}

    def get(spec):
        if repr(spec) not in built:
            built[repr(spec)] = make_moe_checkpoint(tmp_path_factory.mktemp(spec.family), spec)
        return built[repr(spec)]

    return get


def _engine_config(model_dir: str, expert_parallel: bool, absorbed: bool = True, **options) -> EngineConfig:
    return EngineConfig(model_dir=model_dir, block_size=4, num_kv_blocks=128, max_num_seqs=4,
                        max_num_batched_tokens=16, prefill_chunk_tokens=7, max_model_len=96, num_threads=1,
                        tp_size=2, expert_parallel=expert_parallel, mla_absorbed_decode=absorbed, **options)


def _job_rank0(instance: str, port: int, model_dir: str, expert_parallel: bool, prompts: list,
               absorbed: bool = True, **options) -> dict:
    tp = create_tp_group(instance, 0, 2, HOST, port, GROUP_TIMEOUT_S)
    engine = TensorParallelEngine(_engine_config(model_dir, expert_parallel, absorbed, **options), tp)
    try:
        experts = engine.runner.model.model.layers[1].mlp.experts
        shard = (experts.num_local_experts, experts.intermediate_local)
        return {"tokens": _generate(engine, prompts, MAX_TOKENS), "shard": shard}
    finally:
        engine.shutdown()
        tp.close()


def _job_follower(instance: str, port: int, model_dir: str, expert_parallel: bool, absorbed: bool = True,
                  **options) -> dict:
    tp = create_tp_group(instance, 1, 2, HOST, port, GROUP_TIMEOUT_S)
    try:
        runner = build_follower_runner(_engine_config(model_dir, expert_parallel, absorbed, **options), tp)
        return StepFollower(tp).run(runner)._asdict()
    finally:
        tp.close()


SPECS = {
    "qwen3moe-e4": {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
    "deepseekv3-mla-e8": {"family": "deepseek_v3", "num_layers": 3, "n_routed_experts": 8,
                          "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                          "q_lora_rank": 24},
}


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "tp-sharded-experts"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_tp2_moe_greedy_tokens_match_hf(name, expert_parallel, moe_checkpoint, agents, rendezvous):
    from tests.factories import hf_greedy_generate, random_prompts
    from tests.moe_factories import moe_spec

    model_dir = moe_checkpoint(moe_spec(**SPECS[name]))
    prompts = random_prompts(4, 2, 30, 512, seed=17)
    instance, ranks = _new_instance(), agents.take(2)
    ranks[0].submit(_job_rank0, instance=instance, port=rendezvous.port, model_dir=str(model_dir),
                    expert_parallel=expert_parallel, prompts=prompts)
    ranks[1].submit(_job_follower, instance=instance, port=rendezvous.port, model_dir=str(model_dir),
                    expert_parallel=expert_parallel)
    expected = hf_greedy_generate(model_dir, prompts, MAX_TOKENS)  # overlaps with the ranks' work
    replies = [agent.result() for agent in ranks]
    assert all(reply[0] == "ok" for reply in replies), replies
    num_experts = SPECS[name].get("num_experts") or SPECS[name]["n_routed_experts"]
    # EP: half the experts, each whole (32 features); TP-sharded: every expert, half its features.
    assert replies[0][1]["shard"] == ((num_experts // 2, 32) if expert_parallel else (num_experts, 16))
    assert replies[0][1]["tokens"] == expected


def test_tp2_mla_expanded_decode_greedy_tokens_match_hf(moe_checkpoint, agents, rendezvous):
    """`mla_absorbed_decode: false` at TP=2: each rank expands the replicated latents into its own heads."""
    from tests.factories import hf_greedy_generate, random_prompts
    from tests.moe_factories import moe_spec

    model_dir = moe_checkpoint(moe_spec(**SPECS["deepseekv3-mla-e8"]))
    prompts = random_prompts(4, 2, 30, 512, seed=17)
    instance, ranks = _new_instance(), agents.take(2)
    ranks[0].submit(_job_rank0, instance=instance, port=rendezvous.port, model_dir=str(model_dir),
                    expert_parallel=True, prompts=prompts, absorbed=False)
    ranks[1].submit(_job_follower, instance=instance, port=rendezvous.port, model_dir=str(model_dir),
                    expert_parallel=True, absorbed=False)
    expected = hf_greedy_generate(model_dir, prompts, MAX_TOKENS)
    replies = [agent.result() for agent in ranks]
    assert all(reply[0] == "ok" for reply in replies), replies
    assert replies[0][1]["tokens"] == expected


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "tp-sharded-experts"])
def test_tp2_group_wise_int8_experts_match_hf_on_the_dequantized_checkpoint(
    expert_parallel, moe_checkpoint, agents, rendezvous, tmp_path
):
    """Scales over the full checkpoint row: each rank holds whole experts, or whole groups of every
    expert's features (64 per expert, 32 a rank), so TP=2 computes what TP=1 does."""
    from tests.factories import hf_greedy_generate, random_prompts
    from tests.moe_factories import dequantized_moe_checkpoint, moe_spec

    model_dir = moe_checkpoint(moe_spec(**SPECS["qwen3moe-e4"], moe_intermediate_size=64))
    options = {"quantization": "int8", "quantization_group_size": 32}
    prompts = random_prompts(4, 2, 30, 512, seed=17)
    instance, ranks = _new_instance(), agents.take(2)
    ranks[0].submit(_job_rank0, instance=instance, port=rendezvous.port, model_dir=str(model_dir),
                    expert_parallel=expert_parallel, prompts=prompts, **options)
    ranks[1].submit(_job_follower, instance=instance, port=rendezvous.port, model_dir=str(model_dir),
                    expert_parallel=expert_parallel, **options)
    reference = dequantized_moe_checkpoint(model_dir, tmp_path / "dequantized", group_size=32)
    expected = hf_greedy_generate(reference, prompts, MAX_TOKENS)
    replies = [agent.result() for agent in ranks]
    assert all(reply[0] == "ok" for reply in replies), replies
    assert replies[0][1]["shard"] == ((2, 64) if expert_parallel else (4, 32))
    assert replies[0][1]["tokens"] == expected
