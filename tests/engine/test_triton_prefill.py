"""The Triton paged prefill kernel against an fp64 reference and the per-chunk SDPA path
(tests/engine/triton_prefill_checks.py).

On the CPU it runs under Triton's interpreter in a subprocess; on a GPU the compiled kernel runs
(marked `cuda`). Shapes cover GQA / MQA / MHA, a head_dim that is not a power of two, block sizes
smaller and larger than a key tile's pages, chunks with and without a prefix, one-row chunks,
chunks spanning several tiles, and decode rows before the chunks (which the kernel must not touch);
then the engine with the kernel forced on gives HF's greedy tokens over chunked prompts and prefix hits.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention import build_prefill_tiles
from tests.engine.interpreted import run_interpreted
from tests.engine.triton_prefill_checks import check_exact, check_paged_attention_dispatch


def test_prefill_tiles_cover_every_chunk_row_once_in_order():
    tables = (torch.tensor([3, 1]), torch.tensor([0]), torch.tensor([5, 6, 7]))
    tiles = build_prefill_tiles(2, (20, 1, 33), (30, 1, 40), tables, 16, torch.device("cpu"))
    assert tiles.tiles.tolist() == [
        [0, 2, 16, 10], [0, 18, 4, 26],  # 20 rows after 10 cached tokens
        [1, 22, 1, 0],  # a one-token prompt
        [2, 23, 16, 7], [2, 39, 16, 23], [2, 55, 1, 39],  # 33 rows after 7 cached tokens
    ]  # fmt: skip
    assert tiles.block_tables.tolist() == [[3, 1, 0], [0, 0, 0], [5, 6, 7]]
    assert tiles.max_context_len == 40


def test_interpreted_prefill_kernel_equals_references_on_cpu():
    run_interpreted("tests.engine.triton_prefill_checks", "interpreted prefill kernel checks passed", "--engine")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_cuda_prefill_kernel_equals_fp64_reference(dtype, tolerance):
    from engine.kernels import triton_prefill

    check_exact(triton_prefill, "cuda", dtype, tolerance)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cuda_paged_attention_with_tiles_equals_per_chunk_sdpa(dtype, tolerance):
    check_paged_attention_dispatch("cuda", dtype, tolerance)
