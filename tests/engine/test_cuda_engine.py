"""The engine on CUDA: greedy tokens against HF `generate` on the same GPU and dtype.

fp32: token for token, as on the CPU (the Triton decode kernel multiplies in IEEE fp32, no tf32).
bf16: two bf16 runs that sum in different orders drift apart by rounding, and on a near-tie the greedy
pick flips; after that the sequences differ legitimately. The tie tolerance is measured, not guessed:
HF's own bf16 logits against HF's fp32 logits on the same sequences (teacher-forced) give the noise
bf16 itself adds (`bf16_noise`). The rule: every token up to a sequence's first difference is equal,
at that difference our token scores within twice that noise of HF's top score in HF's bf16 logits (a
tie at bf16 precision), and at least half the sequences equal HF's from end to end.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engine import SamplingParams
from tests.factories import TinySpec, hf_greedy_generate, random_prompts

pytestmark = pytest.mark.cuda
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LAYOUTS = {
    "llama-gqa": dict(arch="llama"),
    "qwen3-mha-d32": dict(arch="qwen3", num_heads=4, num_kv_heads=4, head_dim=32),
    "mistral-mqa": dict(arch="mistral", num_heads=4, num_kv_heads=1, head_dim=16),
    "qwen2-tied": dict(arch="qwen2", num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True),
}


def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp32_greedy_equals_hf_on_cuda(layout, cuda_graphs, checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(**LAYOUTS[layout]))
    prompts = random_prompts(6, 1, 90, 512, seed=31)
    expected = hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens, device="cuda")
    llm = make_llm(model_dir, device="cuda", cuda_graphs=cuda_graphs)
    assert _tokens(llm, prompts) == expected


def test_fp32_chunked_prefill_and_prefix_hits_equal_hf_on_cuda(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec())
    shared = random_prompts(1, 40, 40, 512, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(5, 3, 60, 512, seed=3)]
    expected = hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens, device="cuda")
    llm = make_llm(model_dir, device="cuda", prefill_chunk_tokens=16, max_num_batched_tokens=48)
    assert _tokens(llm, prompts[:1]) == expected[:1]  # caches the shared prefix
    assert _tokens(llm, prompts) == expected
    assert llm.engine.runner.kv_cache.values.is_cuda


def test_bf16_greedy_equals_hf_up_to_bf16_ties(checkpoint, make_llm):
    model_dir = checkpoint(TinySpec(dtype="bfloat16", seed=4))
    prompts = random_prompts(8, 5, 80, 512, seed=41)
    hf_tokens, hf_logits = _hf_bf16_with_logits(model_dir, prompts, GREEDY.max_tokens)
    tolerance = 2 * _bf16_noise(model_dir, prompts, hf_tokens, hf_logits)
    llm = make_llm(model_dir, device="cuda")
    assert llm.engine.runner.kv_cache.values.dtype == torch.bfloat16
    ours = _tokens(llm, prompts)
    exact = 0
    for row, (mine, theirs) in enumerate(zip(ours, hf_tokens)):
        if mine == theirs:
            exact += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        scores = hf_logits[step][row].float()
        gap = scores.max().item() - scores[mine[step]].item()
        assert gap <= tolerance, (f"prompt {row}: token {step} is {mine[step]}, HF's {theirs[step]} leads by "
                                  f"{gap:.4f} > {tolerance:.4f} (twice HF's own bf16 noise): not a tie")
    assert exact >= len(prompts) // 2, f"only {exact} of {len(prompts)} sequences equal HF's exactly"


def test_cuda_graph_decode_equals_eager_with_padding_rows(checkpoint, make_llm):
    """5 sequences replay the batch-8 graph: 3 padding rows write to the scratch block only."""
    model_dir = checkpoint(TinySpec(seed=7))
    prompts = random_prompts(5, 2, 50, 512, seed=8)
    graphs = make_llm(model_dir, device="cuda", num_kv_blocks=64)
    eager = make_llm(model_dir, device="cuda", num_kv_blocks=64, cuda_graphs=False)
    assert _tokens(graphs, prompts) == _tokens(eager, prompts)
    runner = graphs.engine.runner
    assert runner.graphs.replays[8] > 0  # 5 rows replayed the padded size
    assert runner.kv_cache.num_blocks == graphs.engine.num_blocks + 1  # the scratch block


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_on_cuda_matches_the_cpu_engine(kv_cache_dtype, checkpoint, make_llm):
    """Same quantizer, same formats: the GPU's tokens equal the CPU engine's, whose error bounds
    tests/engine/test_kv_quant.py states."""
    model_dir = checkpoint(TinySpec(seed=9))
    prompts = random_prompts(4, 5, 60, 512, seed=10)
    cpu = _tokens(make_llm(model_dir, kv_cache_dtype=kv_cache_dtype), prompts)
    assert _tokens(make_llm(model_dir, device="cuda", kv_cache_dtype=kv_cache_dtype), prompts) == cpu


def _bf16_noise(model_dir, prompts, hf_tokens, hf_logits) -> float:
    """Largest |HF bf16 logit - HF fp32 logit| over HF's generated positions, teacher-forced."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    noise = 0.0
    for row, (prompt, new) in enumerate(zip(prompts, hf_tokens)):
        ids = torch.tensor([prompt + new[:-1]], device="cuda")
        with torch.no_grad():
            fp32 = model(ids).logits[0, len(prompt) - 1:].float().cpu()
        bf16 = torch.stack([step[row].float() for step in hf_logits])
        noise = max(noise, (fp32 - bf16).abs().max().item())
    return noise


def _hf_bf16_with_logits(model_dir, prompts, max_new_tokens):
    """HF bf16 greedy on CUDA, one batch left-padded: (new tokens per prompt, logits per step)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda").eval()
    model.generation_config = GenerationConfig(pad_token_id=0)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), do_sample=False,
                             max_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True)
    return [row[width:].tolist() for row in out.sequences], [step.cpu() for step in out.logits]
