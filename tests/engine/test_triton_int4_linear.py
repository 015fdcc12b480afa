"""The Triton group-wise int4 linear kernel (engine/kernels/triton_int4_linear.py) against the fp64
product of the dequantized weights (tests/engine/triton_int4_linear_checks.py), which backend
`int4_matmul` takes where, and the engine running every int4 matmul on the kernel against HF on the
dequantized checkpoint.

On the CPU the kernel runs under Triton's interpreter in a subprocess; on a GPU compiled (marked `cuda`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.layers.int4_matmul import NATIVE_MAX_ROWS, TRITON_MAX_ROWS, select_backend
from tests.engine.interpreted import run_interpreted


def test_interpreted_kernel_equals_references_on_cpu():
    run_interpreted("tests.engine.triton_int4_linear_checks", "interpreted int4 linear checks passed")


def _rows(device: str, dtype: torch.dtype, rows: int):
    """What backend selection reads of the activations; a CUDA device needs no GPU to be named."""
    return SimpleNamespace(device=torch.device(device), is_cuda=device == "cuda", dtype=dtype, shape=(rows, 64))


@pytest.mark.parametrize(
    "device, dtype, rows, backend",
    [
        ("cuda", torch.bfloat16, 1, "triton"),
        ("cuda", torch.float16, TRITON_MAX_ROWS, "triton"),
        ("cuda", torch.bfloat16, TRITON_MAX_ROWS + 1, "dequantize"),
        ("cuda", torch.float32, 1, "dequantize"),  # fp32 dots miss the tensor cores
        ("cpu", torch.bfloat16, 1, "dequantize"),
        ("cpu", torch.float32, NATIVE_MAX_ROWS + 1, "dequantize"),
    ],
)
def test_backend_selection_by_device_dtype_and_rows(device, dtype, rows, backend):
    assert select_backend(_rows(device, dtype, rows)).name == backend


def test_cpu_decode_rows_of_fp32_models_take_the_c_kernel_where_it_is_built():
    from engine.kernels import kernel

    expected = "native" if kernel("int4_linear") is not None else "dequantize"
    assert select_backend(torch.zeros(NATIVE_MAX_ROWS, 64)).name == expected


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_cuda_kernel_equals_fp64_reference(dtype, tolerance):
    from tests.engine.triton_int4_linear_checks import check_exact

    check_exact("cuda", dtype, tolerance)


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_int4_engine_equals_hf_on_the_dequantized_checkpoint(cuda_graphs, checkpoint, make_llm, tmp_path):
    """A GPTQ checkpoint kept in int4, fp32 with every matmul forced onto the kernel: HF-exact tokens."""
    from engine import SamplingParams
    from engine.quantization import checkpoint_format
    from engine.quantization.writer import write_rtn
    from tests.engine.test_quantized_checkpoints import CONFIGS, SPEC, dequantized_reference
    from tests.engine.triton_int4_linear_checks import triton_backend_forced
    from tests.factories import hf_greedy_generate, random_prompts

    config = CONFIGS["gptq-v1-w4-g32-sym"]
    model_dir = checkpoint(SPEC)
    quantized = write_rtn(model_dir, tmp_path / "quantized", checkpoint_format({"quantization_config": config}))
    reference = dequantized_reference(model_dir, quantized, config, tmp_path / "reference")
    prompts = random_prompts(4, 2, 40, SPEC.vocab_size, seed=61)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = hf_greedy_generate(reference, prompts, greedy.max_tokens, device="cuda")
    with triton_backend_forced():
        llm = make_llm(str(quantized), device="cuda", dtype="float32", cuda_graphs=cuda_graphs, quantization="int4")
        assert [list(o.token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
