"""Absorbed MLA decode (`mla_absorbed_decode`, on by default): decode attends over the latent cache
directly, kv_b's key half folded into the query and its value half into the output. The MoE matrix
(tests/engine/test_moe_exactness.py: chunked prefill, prefix hits, preemption, n-gram verify rows, int8
weights and caches, the role split) runs it, as do the TP=2 and cluster tests; here: the expanded
computation (`false`) keeps HF's tokens on every DeepSeek shape, and the two computations agree within
fp32 rounding, the stated bound: |absorbed - expanded| <= 1e-5 x max |expanded| per layer output."""
from __future__ import annotations

import pytest
import torch

from engine.models.mla import MLAttention
from tests.engine.test_moe_exactness import MAX_TOKENS, SPECS, _tokens, moe_checkpoint  # noqa: F401
from tests.factories import hf_greedy_generate, random_prompts

MLA_SPECS = sorted(name for name in SPECS if name.startswith("deepseek"))
ABSORBED_REL_TOL = 1e-5  # fp32: the same products summed in another order


def _mla_layers(llm) -> list[MLAttention]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, MLAttention)]


@pytest.mark.parametrize("name", MLA_SPECS)
def test_expanded_decode_greedy_tokens_equal_hf(name, moe_checkpoint, make_llm):  # noqa: F811
    model_dir = moe_checkpoint(SPECS[name])
    prompts = random_prompts(4, 2, 40, 512, seed=11)
    llm = make_llm(model_dir, num_kv_blocks=128, prefill_chunk_tokens=7, max_num_batched_tokens=24,
                   mla_absorbed_decode=False)
    assert _mla_layers(llm) and not any(layer.absorbed_decode for layer in _mla_layers(llm))
    assert _tokens(llm, prompts) == hf_greedy_generate(model_dir, prompts, MAX_TOKENS)


def test_absorbed_decode_is_the_default(moe_checkpoint, make_llm):  # noqa: F811
    llm = make_llm(moe_checkpoint(SPECS["deepseekv2-yarn"]), num_kv_blocks=16)
    assert _mla_layers(llm) and all(layer.absorbed_decode for layer in _mla_layers(llm))


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("name", ["deepseekv3-halfrope-2shared", "deepseekv2-yarn", "deepseekv3-grouped-qlora-dense1"])
def test_absorbed_attention_equals_expanded_within_fp32_rounding(name, quantization, moe_checkpoint, make_llm):  # noqa: F811
    """The stated bound, on every layer: both computations of six decode rows over random latents (a
    context of 37 tokens, 5 of them padding); with int8 weights, the folded weights are the int8 values
    times their scales, as the expanded path multiplies by."""
    llm = make_llm(moe_checkpoint(SPECS[name]), num_kv_blocks=16, quantization=quantization)
    gen = torch.Generator().manual_seed(3)
    for layer in _mla_layers(llm):
        mla = layer.mla
        queries = torch.randn(6, layer.num_heads, mla.qk_head_dim, generator=gen)
        latents = torch.randn(6, 37, mla.latent_dim, generator=gen)
        padding = torch.zeros(6, 37, dtype=torch.bool)
        padding[:, 32:] = True
        expanded = layer._expanded_attention(queries, latents, padding)
        absorbed = layer._absorbed_attention(queries, latents, padding)
        error = (absorbed - expanded).abs().max().item()
        assert error <= ABSORBED_REL_TOL * expanded.abs().max().item(), error
        padded = latents.clone()
        padded[:, 32:] = 1e3  # what padding rows hold must not reach the output
        assert torch.equal(layer._absorbed_attention(queries, padded, padding), absorbed)
