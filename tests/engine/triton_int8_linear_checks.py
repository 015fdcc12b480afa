"""Checks of the Triton int8 linear kernel, shared by the CPU (interpreted) and CUDA tests.

`python -m tests.engine.triton_int8_linear_checks [--engine]` with `TRITON_INTERPRET=1` runs them on
the CPU under Triton's interpreter, in a fresh process (see tests/engine/triton_decode_checks.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.layers import int8_matmul
from engine.layers.quantization import quantize_per_channel

# rows, in features, out features: ragged tails in every dimension, one row, several row tiles.
SHAPES = [(1, 256, 96), (3, 200, 37), (16, 64, 64), (17, 130, 70), (40, 512, 33), (70, 96, 130)]


def _case(rows, k, n, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    values, scale = quantize_per_channel(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    exact = x.double() @ (values.double() * scale.double()[:, None]).T
    return x.to(device=device, dtype=dtype), values.to(device), scale.to(device), exact


def plans(rows, k, n):
    """The default plan, and forced ones: no split, and a split into single tiles (workspace path)."""
    from engine.kernels.triton_int8_linear import LaunchPlan, launch_plan

    default = launch_plan(rows, n, k)
    tiles_k = -(-k // default.block_k)
    return [
        default,
        default._replace(num_splits=1, tiles_per_split=tiles_k),
        default._replace(num_splits=tiles_k, tiles_per_split=1),
        LaunchPlan(16, 32, 32, -(-k // 64), 2, 4),  # small tiles, two per split
    ]


def check_exact(device, dtype, tolerance):
    """Every plan against the fp64 product of the dequantized weights, relative to the output's size."""
    from engine.kernels.triton_int8_linear import int8_linear

    for index, (rows, k, n) in enumerate(SHAPES):
        x, values, scale, exact = _case(rows, k, n, dtype, device, seed=index)
        for plan in plans(rows, k, n):
            got = int8_linear(x, values, scale, plan)
            assert got.dtype == dtype and got.shape == (rows, n), (plan, got.dtype, got.shape)
            error = ((got.double().cpu() - exact).abs().max() / exact.abs().max()).item()
            assert error <= tolerance, (rows, k, n, plan, dtype, error)


@contextmanager
def triton_backend_forced():
    """`int8_matmul` dispatches every call to the Triton kernel (interpreted on the CPU)."""
    forced = int8_matmul.Backend("triton", lambda x: True, int8_matmul._triton)
    saved = int8_matmul.BACKENDS
    int8_matmul.BACKENDS = (forced,)
    try:
        yield
    finally:
        int8_matmul.BACKENDS = saved


def check_engine_equals_dequantized_hf(model_dir, out_dir, device: str) -> None:
    """The int8-weight engine with every matmul on the kernel gives HF's greedy tokens on the
    dequantized checkpoint (fp32; chunked prompts and prefix hits: prefill and decode shapes)."""
    from engine import LLM, SamplingParams
    from tests.factories import dequantized_checkpoint, hf_greedy_generate, random_prompts

    reference = dequantized_checkpoint(model_dir, out_dir, quantize_lm_head=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    shared = random_prompts(1, 40, 40, 512, seed=2)[0]
    prompts = [shared + tail for tail in random_prompts(4, 1, 30, 512, seed=3)]
    expected = hf_greedy_generate(reference, prompts, greedy.max_tokens, device=device)
    llm = LLM(model_dir, progress=False, device=device, quantization="int8", quantize_lm_head=True,
              prefill_chunk_tokens=16, max_num_batched_tokens=48)
    tokens = lambda batch: [list(o.token_ids) for o in llm.generate(batch, greedy, use_tqdm=False)]  # noqa: E731
    with triton_backend_forced():
        assert tokens(prompts[:1]) == expected[:1]  # caches the shared prefix
        assert tokens(prompts) == expected


if __name__ == "__main__":
    import sys
    import tempfile
    from pathlib import Path

    from tests.factories import TinySpec, make_tiny_checkpoint

    check_exact("cpu", torch.float32, 1e-5)
    check_exact("cpu", torch.float16, 4e-3)  # the interpreter has no bf16 (numpy): CUDA tests take it
    if "--engine" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_tiny_checkpoint(Path(tmp) / "llama", TinySpec())
            check_engine_equals_dequantized_hf(model_dir, Path(tmp) / "dequantized", "cpu")
    print("interpreted int8 linear checks passed")
