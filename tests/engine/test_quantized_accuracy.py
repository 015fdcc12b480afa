"""Quantized engines against the fp32 engine on tiny random checkpoints of every supported family:
teacher-forced top-1 agreement, the prefill → decode role split with a quantized cache, and the
int8 weight layers' error.

Accuracy checkpoints use HF's default initializer range (TinySpec.weight_std=0.02). The exactness
checkpoints (std 0.25) make attention so sharp that rounding the KV cache to bf16, which every engine
does for bf16 models, already flips 2-3% of teacher-forced argmaxes: they measure chaos, not a format
(benchmarks/quant_accuracy.py prints both; README).
"""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.layers.quantization import quantize_per_channel
from engine.sequence import FinishReason
from engine.teacher_forcing import teacher_forced_logits
from tests.conftest import assert_engine_clean
from tests.factories import TinySpec, random_prompts

FAMILIES = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2", hidden_size=64, num_heads=4, head_dim=16),
    "mistral": dict(arch="mistral", num_kv_heads=1),
    "qwen3": dict(arch="qwen3"),
}
# Teacher-forced top-1 agreement with the fp32 engine, 480 positions per family. Seen over seeds 7-9
# of every family: int8 0.9937-1.0, fp8 0.975-0.992. int8 meets the 99% target; fp8 e4m3
# (3 mantissa bits: up to 6% relative error per value, about 16x int8's per-token step) does not on
# random checkpoints, whose top-2 logit margins are tiny (README: the accuracy report).
TOP1_MIN = {"int8": 0.99, "fp8": 0.97}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_teacher_forced_top1_agreement_with_the_fp32_engine(family, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(weight_std=0.02, seed=7, **FAMILIES[family]))
    prompts = random_prompts(10, 5, 90, 512, seed=3)
    reference = make_llm(model_dir)
    continuations = [list(o.token_ids) for o in reference.generate(prompts, _greedy(48), use_tqdm=False)]
    expected = torch.cat(teacher_forced_logits(reference.engine, prompts, continuations)).argmax(-1)
    for kv_cache_dtype in ("int8", "fp8"):
        # Small prefill chunks: later chunks attend to earlier ones through the quantized cache too.
        llm = make_llm(model_dir, kv_cache_dtype=kv_cache_dtype, prefill_chunk_tokens=32)
        got = torch.cat(teacher_forced_logits(llm.engine, prompts, continuations)).argmax(-1)
        agreement = (got == expected).float().mean().item()
        assert agreement >= TOP1_MIN[kv_cache_dtype], f"{kv_cache_dtype}: top-1 agreement {agreement:.4f}"


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_prefill_role_hands_quantized_blocks_to_a_decode_role_engine(kv_cache_dtype, checkpoint, make_llm):
    """Blocks and scales copied as stored (no dequantize-requantize) continue the sequence exactly as
    the colocated engine with the same KV dtype does."""
    model_dir = checkpoint(TinySpec(num_kv_heads=2))
    prompts = random_prompts(3, 5, 50, 512, seed=59)
    colocated = make_llm(model_dir, kv_cache_dtype=kv_cache_dtype)
    expected = [list(o.token_ids) for o in colocated.generate(prompts, _greedy(10), use_tqdm=False)]
    prefill = make_llm(model_dir, role="prefill", kv_cache_dtype=kv_cache_dtype).engine
    decode = make_llm(model_dir, role="decode", kv_cache_dtype=kv_cache_dtype).engine
    for index, prompt in enumerate(prompts):
        prefill.add_request(f"r{index}", prompt, _greedy(10))
    handed = []
    while prefill.has_unfinished():
        handed += [u.seq_id for u in prefill.step() if u.finish_reason is FinishReason.HANDOFF]
    for seq_id in handed:
        handoff = prefill.handoff_blocks(seq_id)
        target = decode.reserve(seq_id, handoff.num_computed_tokens)
        decode.runner.kv_cache.copy_blocks_from(prefill.runner.kv_cache, handoff.block_ids, target)
        prefill.release(seq_id)
        decode.adopt(seq_id, handoff.token_ids, len(handoff.token_ids) - 1, _greedy(10))
    while decode.has_unfinished():
        decode.step()
    assert [decode.pop_finished(f"r{i}").output_token_ids for i in range(3)] == expected
    assert_engine_clean(prefill)


def test_each_int8_layer_is_within_its_stated_error(checkpoint, make_llm):
    """Every quantized linear layer of the model against the same layer in fp32, on random inputs:
    per output channel the error is at most (sum of |x|) * scale / 2 (each weight is off by at most
    half a step); over a layer the relative error stays under 1% for gaussian-like weights."""
    model_dir = checkpoint(TinySpec(arch="qwen2", hidden_size=64, num_heads=4, head_dim=16))
    fp32 = make_llm(model_dir).engine.runner.model
    int8 = make_llm(model_dir, quantization="int8", quantize_lm_head=True).engine.runner.model
    layers = [name for name, module in int8.named_modules() if hasattr(module, "weight_scale")]
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    gen = torch.Generator().manual_seed(0)
    for name in layers:
        ours, theirs = int8.get_submodule(name), fp32.get_submodule(name)
        x = torch.randn(5, theirs.weight.shape[1], generator=gen)
        got, want = ours(x), theirs(x)
        bound = x.abs().sum(-1, keepdim=True) * ours.weight_scale.view(1, -1) / 2
        assert torch.all((got - want).abs() <= bound + 1e-5), name
        assert ((got - want).norm() / want.norm()).item() < 0.01, name
        values, scale = quantize_per_channel(theirs.weight)
        assert torch.equal(ours.weight, values) and torch.equal(ours.weight_scale.view(-1), scale)


def test_int8_weights_and_kv_generate_cleanly_with_prefix_hits_and_preemption(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(arch="qwen3"))
    system = random_prompts(1, 40, 40, 512, seed=31)[0]
    prompts = [system + p for p in random_prompts(6, 3, 30, 512, seed=32)]
    llm = make_llm(model_dir, quantization="int8", kv_cache_dtype="int8", block_size=4, num_kv_blocks=60,
                   prefill_chunk_tokens=7, max_num_batched_tokens=20)
    first = llm.generate(prompts, _greedy(20), use_tqdm=False)
    again = llm.generate(prompts, _greedy(20), use_tqdm=False)
    assert all(len(o.token_ids) == 20 for o in first + again)
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_int8_weight_engine_equals_hf_on_the_dequantized_checkpoint(family, checkpoint, make_llm, tmp_path):
    """int8 weights are exactly a model whose weights are their int8 value x scale: greedy tokens equal
    HF `generate` on that checkpoint (fp32), through the C kernel (decode rows) and the widened BLAS
    matmul (prefill chunks of more than NATIVE_MAX_ROWS rows), the LM head quantized too. (The fp32
    engine's tokens differ from that reference on every family: the check sees the quantization.)"""
    from engine.layers.int8_matmul import NATIVE_MAX_ROWS
    from tests.factories import dequantized_checkpoint, hf_greedy_generate

    spec = {**FAMILIES[family], "tie_word_embeddings": False}
    model_dir = checkpoint(TinySpec(**spec, seed=21))
    reference = dequantized_checkpoint(model_dir, tmp_path / "dequantized", quantize_lm_head=True)
    prompts = (random_prompts(4, NATIVE_MAX_ROWS + 10, NATIVE_MAX_ROWS + 40, 512, seed=22)
               + random_prompts(3, 2, 20, 512, seed=23))
    expected = hf_greedy_generate(reference, prompts, 12)
    llm = make_llm(model_dir, quantization="int8", quantize_lm_head=True, max_num_batched_tokens=256)
    assert [list(o.token_ids) for o in llm.generate(prompts, _greedy(12), use_tqdm=False)] == expected
