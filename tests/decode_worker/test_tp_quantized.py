"""Quantized tensor parallelism over real processes: with int8 weights (per output channel or per group
of 32 inputs, and an int8 / fp8 KV cache) a TP=2 instance produces the greedy tokens a single-rank
engine with the same quantization produces.

Row-parallel layers take each output channel's (or group's) scale from the full checkpoint row, so every
rank's int8 weights are exactly its slice of the single-rank weights and only the summation order differs.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from decode_worker.tp_group import build_follower_runner, create_tp_group, StepFollower
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.conftest import assert_engine_clean
from tests.decode_worker.test_tp_group import (GROUP_TIMEOUT_S, HOST, _CountingEngine, _finish_instance, _generate,
                                               _new_instance)

MAX_TOKENS = 8


def _config(model_dir: str, tp_size: int, kv_cache_dtype: str, group_size: int | None = None) -> EngineConfig:
    return EngineConfig(model_dir=model_dir, block_size=4, num_kv_blocks=128, max_num_seqs=4,
                        max_num_batched_tokens=16, prefill_chunk_tokens=7, max_model_len=96, num_threads=1,
                        tp_size=tp_size, quantization="int8", kv_cache_dtype=kv_cache_dtype,
                        quantization_group_size=group_size)


def _job_rank0(instance: str, port: int, model_dir: str, kv_cache_dtype: str, group_size: int | None,
               prompts: list) -> dict:
    tp = create_tp_group(instance, 0, 2, HOST, port, GROUP_TIMEOUT_S)
    engine = _CountingEngine(_config(model_dir, 2, kv_cache_dtype, group_size), tp)
    try:
        return {"tokens": _generate(engine, prompts, MAX_TOKENS), "num_steps": engine.num_steps}
    finally:
        engine.shutdown()
        tp.close()


def _job_follower(instance: str, port: int, model_dir: str, kv_cache_dtype: str, group_size: int | None) -> dict:
    tp = create_tp_group(instance, 1, 2, HOST, port, GROUP_TIMEOUT_S)
    try:
        runner = build_follower_runner(_config(model_dir, 2, kv_cache_dtype, group_size), tp)
        return StepFollower(tp, heartbeat_timeout_s=5.0).run(runner)._asdict()
    finally:
        tp.close()


@pytest.mark.parametrize("kv_cache_dtype, group_size", [("auto", None), ("int8", None), ("auto", 32)])
def test_tp2_with_int8_weights_equals_tp1_with_the_same_quantization(kv_cache_dtype, group_size, checkpoint, agents,
                                                                    rendezvous):
    from tests.factories import TinySpec, random_prompts

    model_dir = str(checkpoint(TinySpec(num_heads=4, num_kv_heads=2)))
    prompts = random_prompts(4, 2, 30, 512, seed=23)
    ranks, instance = agents.take(2), _new_instance()
    ranks[0].submit(_job_rank0, instance=instance, port=rendezvous.port, model_dir=model_dir,
                    kv_cache_dtype=kv_cache_dtype, group_size=group_size, prompts=prompts)
    ranks[1].submit(_job_follower, instance=instance, port=rendezvous.port, model_dir=model_dir,
                    kv_cache_dtype=kv_cache_dtype, group_size=group_size)
    # In this process (overlapping with the ranks' work), without changing its torch thread count.
    single = LLMEngine(replace(_config(model_dir, 1, kv_cache_dtype, group_size), num_threads=None))
    expected = _generate(single, prompts, MAX_TOKENS)
    assert_engine_clean(single)
    assert _finish_instance(ranks) == expected
