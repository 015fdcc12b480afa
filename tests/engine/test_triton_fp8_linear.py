"""The Triton fp8 linear kernel (engine/kernels/triton_fp8_linear.py): its e4m3 decoding against torch's
float8_e4m3fn conversion, its products against the fp64 product of the dequantized weights, and the
engine keeping a block-scaled FP8 checkpoint in e4m3 on the kernel against HF on the dequantized weights
(tests/engine/triton_fp8_linear_checks.py).

On the CPU the kernel runs under Triton's interpreter in a subprocess; on a GPU compiled (marked `cuda`).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.interpreted import run_interpreted


def test_interpreted_kernel_equals_references_on_cpu():
    run_interpreted("tests.engine.triton_fp8_linear_checks", "interpreted fp8 linear checks passed", "--engine")


@pytest.mark.cuda
def test_cuda_decoding_equals_torch_for_every_e4m3_bit_pattern():
    from tests.engine.triton_fp8_linear_checks import check_decode

    check_decode("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_cuda_kernel_equals_fp64_reference(dtype, tolerance):
    from tests.engine.triton_fp8_linear_checks import check_exact

    check_exact("cuda", dtype, tolerance)


@pytest.mark.cuda
def test_cuda_fp8_engine_on_the_kernel_equals_hf_on_the_dequantized_checkpoint(checkpoint, tmp_path):
    from tests.engine.test_quantized_checkpoints import SPEC
    from tests.engine.triton_fp8_linear_checks import check_engine_equals_hf

    check_engine_equals_hf(checkpoint(SPEC), tmp_path, "cuda")


@pytest.mark.cuda
def test_cuda_keeps_an_fp8_checkpoint_in_e4m3_and_equals_transformers(checkpoint, make_llm, tmp_path):
    """Unforced: on CUDA the decoder's projections hold e4m3 weights (1 byte each), the LM head the
    model dtype; fp32 steps widen per layer (the `dequantize` backend), tokens equal transformers'."""
    from engine import SamplingParams
    from engine.quantization import checkpoint_format
    from engine.quantization.writer import write_rtn
    from tests.engine.test_quantized_checkpoints import SPEC
    from tests.factories import hf_greedy_generate, random_prompts

    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    quantized = write_rtn(checkpoint(SPEC), tmp_path / "quantized", checkpoint_format({"quantization_config": config}))
    prompts = random_prompts(3, 2, 24, SPEC.vocab_size, seed=43)
    expected = hf_greedy_generate(quantized, prompts, 10)
    llm = make_llm(str(quantized), device="cuda", dtype="float32")
    model = llm.engine.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    assert [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected
