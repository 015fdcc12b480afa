"""int4 weights over a TP=2 decode instance in real processes: greedy fp32 tokens equal HF `generate` on
the checkpoint's dequantized weights
- for an act-order GPTQ checkpoint (`splitserve quantize --act-order`), whose row-parallel o_proj and
  down_proj shards hold parts of groups (each rank keeps the groups its inputs touch);
- for GPTQ and act-order mixture-of-experts checkpoints with int4 experts split across the ranks
  (expert parallel), each rank holding half the experts in 4 bits, and for TP-sharded int4 experts
  (every rank holding whole groups of every expert's features).

The ranks run in the spawned agents of tests/decode_worker/test_tp_group.py, on the real gloo groups
and step broadcast a decode instance uses.
"""

from __future__ import annotations

import pytest

from decode_worker.tp_group import StepFollower, TensorParallelEngine, build_follower_runner, create_tp_group
from engine.config import EngineConfig
from tests.decode_worker.test_tp_group import HOST, _generate, _new_instance

GROUP_TIMEOUT_S = 30.0
MAX_TOKENS = 8


def _engine_config(model_dir: str, expert_parallel: bool = True) -> EngineConfig:
    return EngineConfig(
        model_dir=model_dir,
        block_size=4,
        num_kv_blocks=128,
        max_num_seqs=4,
        max_num_batched_tokens=48,
        prefill_chunk_tokens=40,
        max_model_len=96,
        num_threads=1,
        tp_size=2,
        quantization="int4",
        expert_parallel=expert_parallel,
    )


def _job_rank0(instance: str, port: int, model_dir: str, prompts: list, expert_parallel: bool = True) -> dict:
    from engine.layers.fused_moe import FusedMoE
    from engine.layers.linear import RowParallelLinear

    tp = create_tp_group(instance, 0, 2, HOST, port, GROUP_TIMEOUT_S)
    engine = TensorParallelEngine(_engine_config(model_dir, expert_parallel), tp)
    try:
        modules = list(engine.runner.model.modules())
        rows = [m for m in modules if isinstance(m, RowParallelLinear) and getattr(m, "input_order", None) is not None]
        experts = [m for m in modules if isinstance(m, FusedMoE)]
        return {
            "tokens": _generate(engine, prompts, MAX_TOKENS),
            "act_order_row_shards": sum(m.input_padded for m in rows),
            "experts": [(m.num_local_experts, str(m.w13_weight.dtype), str(m.w2_weight.dtype)) for m in experts],
            "padded_expert_layers": sum("w2_weight" in m.method.padded for m in experts),
        }
    finally:
        engine.shutdown()
        tp.close()


def _job_follower(instance: str, port: int, model_dir: str, expert_parallel: bool = True) -> dict:
    tp = create_tp_group(instance, 1, 2, HOST, port, GROUP_TIMEOUT_S)
    try:
        return StepFollower(tp).run(build_follower_runner(_engine_config(model_dir, expert_parallel), tp))._asdict()
    finally:
        tp.close()


def _served(agents, rendezvous, model_dir, prompts, expert_parallel: bool = True) -> dict:
    instance, ranks = _new_instance(), agents.take(2)
    common = {
        "instance": instance,
        "port": rendezvous.port,
        "model_dir": str(model_dir),
        "expert_parallel": expert_parallel,
    }
    ranks[0].submit(_job_rank0, prompts=prompts, **common)
    ranks[1].submit(_job_follower, **common)
    replies = [agent.result() for agent in ranks]
    assert all(reply[0] == "ok" for reply in replies), replies
    return replies[0][1]


def test_tp2_act_order_gptq_in_int4_equals_hf_on_its_dequantized_weights(agents, rendezvous, checkpoint, tmp_path):
    import json

    from splitserve.cli import main as cli_main
    from tests.engine.test_quantize_command import CALIBRATION, RUNS
    from tests.engine.test_quantized_checkpoints import SPEC, dequantized_reference
    from tests.factories import hf_greedy_generate, random_prompts

    model_dir, out = checkpoint(SPEC), tmp_path / "quantized"
    cli_main(["quantize", str(model_dir), str(out), *RUNS["gptq-w4-g32-act"], *CALIBRATION])
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    reference = dequantized_reference(model_dir, out, config, tmp_path / "reference")
    prompts = random_prompts(4, 2, 40, SPEC.vocab_size, seed=61)
    reply = _served(agents, rendezvous, out, prompts)
    assert reply["act_order_row_shards"] == 2 * SPEC.num_layers  # o_proj and down_proj of every layer
    assert reply["tokens"] == hf_greedy_generate(reference, prompts, MAX_TOKENS)


@pytest.mark.parametrize("case", ["qwen3moe-gptq-g32-asym", "mixtral-gptq-g32-asym-act"])
def test_tp2_expert_parallel_int4_experts_equal_hf_on_the_dequantized_checkpoint(case, agents, rendezvous, tmp_path):
    from tests.engine.test_moe_int4_weights import SPECS, dequantized_moe_reference, quantize_moe
    from tests.engine.test_quantized_checkpoints import CONFIGS
    from tests.factories import hf_greedy_generate, random_prompts
    from tests.moe_factories import make_moe_checkpoint

    family, config = (
        case.split("-")[0],
        CONFIGS["gptq-v1-w4-g32-asym-act" if case.endswith("act") else "gptq-v1-w4-g32-sym"],
    )
    config = {**config, "sym": False}
    model_dir = make_moe_checkpoint(tmp_path / "model", SPECS[family])
    quantized = quantize_moe(model_dir, tmp_path / "quantized", config)
    reference = dequantized_moe_reference(model_dir, quantized, tmp_path / "reference")
    prompts = random_prompts(4, 2, 40, 512, seed=62)
    reply = _served(agents, rendezvous, quantized, prompts)
    assert reply["experts"] and all(shard == (2, "torch.uint8", "torch.uint8") for shard in reply["experts"])
    assert reply["tokens"] == hf_greedy_generate(reference, prompts, MAX_TOKENS)


@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_tp2_tp_sharded_int4_experts_equal_hf_on_the_dequantized_checkpoint(act_order, agents, rendezvous, tmp_path):
    """`expert_parallel: false`: every rank holds every expert, half its 64 intermediate features in 4
    bits (one whole group of 32; with act-order, the groups those features touch, padded)."""
    from tests.engine.test_moe_int4_weights import SPECS, dequantized_moe_reference, quantize_moe
    from tests.engine.test_quantized_checkpoints import CONFIGS
    from tests.factories import hf_greedy_generate, random_prompts
    from tests.moe_factories import make_moe_checkpoint

    model_dir = make_moe_checkpoint(tmp_path / "model", SPECS["qwen3moe"])
    how = CONFIGS["gptq-v1-w4-g32-asym-act"] if act_order else ["--method", "rtn", "--group-size", "32", "--asym"]
    quantized = quantize_moe(model_dir, tmp_path / "quantized", how)
    reference = dequantized_moe_reference(model_dir, quantized, tmp_path / "reference")
    prompts = random_prompts(4, 2, 40, 512, seed=63)
    reply = _served(agents, rendezvous, quantized, prompts, expert_parallel=False)
    assert reply["experts"] and all(shard == (4, "torch.uint8", "torch.uint8") for shard in reply["experts"])
    assert reply["padded_expert_layers"] == (len(reply["experts"]) if act_order else 0)
    assert reply["tokens"] == hf_greedy_generate(reference, prompts, MAX_TOKENS)
