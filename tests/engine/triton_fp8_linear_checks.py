"""Checks of the Triton fp8 linear kernel, shared by the CPU (interpreted) and CUDA tests.

`python -m tests.engine.triton_fp8_linear_checks [--engine]` with `TRITON_INTERPRET=1` runs them on
the CPU under Triton's interpreter, in a fresh process (tests/engine/interpreted.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from engine.layers import fp8_matmul, quantization

# rows, in features, out features, (block_out, block_in): DeepSeek's 128 x 128 with partial last blocks
# in both dimensions, blocks that are not powers of two, per-tensor ([out, in]) and per-channel
# ([1, in]) scales, one row and odd row counts past a row tile.
SHAPES = [
    (1, 200, 130, (128, 128)),
    (3, 96, 70, (32, 48)),
    (17, 64, 40, (1, 64)),
    (5, 130, 33, (33, 130)),
    (40, 160, 24, (7, 20)),
]


def _case(rows, k, n, block_size, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    block_out, block_in = block_size
    weight = (torch.randn(n, k, generator=gen) * 64).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block_out), -(-k // block_in), generator=gen) + 0.05
    full = scale.repeat_interleave(block_out, dim=0)[:n].repeat_interleave(block_in, dim=1)[:, :k]
    dequantized = (weight.float() * full).to(dtype)  # what the dequantize path widens the layer to
    x = torch.randn(rows, k, generator=gen).to(dtype)
    exact = x.double() @ dequantized.double().T
    return x.to(device), weight.to(device), scale.to(device), exact


def plans(rows, k, n):
    """The default plan, and forced ones: a split per tile (workspace path), small tiles two per split."""
    from engine.kernels.triton_int8_linear import LaunchPlan, heuristic_plan

    default = heuristic_plan(rows, n, k)
    tiles_k = -(-k // default.block_k)
    return [default, default._replace(num_splits=tiles_k, tiles_per_split=1), LaunchPlan(16, 32, 32, -(-k // 64), 2, 4)]


def check_decode(device):
    """Every e4m3 bit pattern but the two NaNs decodes to torch's float8_e4m3fn value (signed zeros too)."""
    from engine.kernels.triton_fp8_linear import e4m3_to_float

    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = bits.view(torch.float8_e4m3fn).float()
    got = e4m3_to_float(bits.to(device)).cpu()
    finite = ~expected.isnan()
    assert finite.sum() == 254
    assert torch.equal(got[finite], expected[finite]), (got - expected)[finite].abs().max()
    assert torch.equal(got[finite].signbit(), expected[finite].signbit())


def check_exact(device, dtype, tolerance):
    """Every plan against the fp64 product of the weights dequantized to `dtype`, relative to the
    output's size."""
    from engine.kernels.triton_fp8_linear import fp8_linear

    for index, (rows, k, n, block_size) in enumerate(SHAPES):
        x, weight, scale, exact = _case(rows, k, n, block_size, dtype, device, seed=index)
        for plan in plans(rows, k, n):
            got = fp8_linear(x, weight, scale, block_size, plan)
            assert got.dtype == dtype and got.shape == (rows, n), (plan, got.dtype, got.shape)
            error = ((got.double().cpu() - exact).abs().max() / exact.abs().max()).item()
            assert error <= tolerance, (rows, k, n, block_size, plan, dtype, error)


@contextmanager
def stored_fp8_forced(device_type: str):
    """FP8 checkpoints keep their e4m3 weights on `device_type` and every fp8 matmul runs the kernel
    (interpreted on the CPU)."""
    saved_forms, saved_backends = dict(quantization.STORED_FORMS), fp8_matmul.BACKENDS
    devices, method = quantization.STORED_FORMS["fp8"]
    quantization.STORED_FORMS["fp8"] = (devices | {device_type}, method)
    fp8_matmul.BACKENDS = (fp8_matmul.Backend("triton", lambda x: True, fp8_matmul._triton),)
    try:
        yield
    finally:
        quantization.STORED_FORMS.clear()
        quantization.STORED_FORMS.update(saved_forms)
        fp8_matmul.BACKENDS = saved_backends


def check_engine_equals_hf(model_dir: Path, out_dir: Path, device: str) -> None:
    """A block-scaled fp8 checkpoint (blocks of 32 x 48: partial in the 64-wide inputs) with every
    decoder projection kept in e4m3 and on the kernel gives the greedy tokens of HF on its dequantized
    weights (fp32; prefill chunks and decode rows)."""
    from engine import LLM, SamplingParams
    from engine.quantization import checkpoint_format
    from engine.quantization.writer import write_rtn
    from tests.engine.test_quantized_checkpoints import dequantized_reference
    from tests.factories import hf_greedy_generate, random_prompts

    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 48]}
    quantized = write_rtn(model_dir, out_dir / "quantized", checkpoint_format({"quantization_config": config}))
    reference = dequantized_reference(model_dir, quantized, config, out_dir / "reference")
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts(2, 6, 20, 512, seed=41)
    expected = hf_greedy_generate(reference, prompts, greedy.max_tokens, device=device)
    with stored_fp8_forced(torch.device(device).type):
        llm = LLM(str(quantized), progress=False, device=device, dtype="float32", prefill_chunk_tokens=16)
        layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_block_in == 48
        assert [list(o.token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected


if __name__ == "__main__":
    import sys
    import tempfile

    from tests.engine.test_quantized_checkpoints import SPEC
    from tests.factories import make_tiny_checkpoint

    check_decode("cpu")
    check_exact("cpu", torch.float32, 1e-6)
    check_exact("cpu", torch.float16, 2e-3)  # the interpreter has no bf16 (numpy): CUDA tests take it
    if "--engine" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            check_engine_equals_hf(make_tiny_checkpoint(Path(tmp) / "llama", SPEC), Path(tmp), "cpu")
    print("interpreted fp8 linear checks passed")
