"""The Triton weight-only int8 linear kernel (engine/kernels/triton_int8_linear.py) against the fp64
product of the dequantized weights, and the engine running every matmul on it against HF on the
dequantized checkpoint (tests/engine/triton_int8_linear_checks.py).

On the CPU the kernel runs under Triton's interpreter in a subprocess; on a GPU compiled (marked
`cuda`). Shapes have ragged tails in rows, input and output features; each runs under the default
launch plan and forced ones (no split, a split per tile, small tiles).
"""
from __future__ import annotations

import pytest
import torch

from engine.kernels import triton_int8_linear
from engine.kernels.triton_int8_linear import MIN_SPLIT_FEATURES, LaunchPlan, heuristic_plan, launch_plan, load_plans
from tests.engine.interpreted import run_interpreted


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 64, 65, 256, 300])
@pytest.mark.parametrize("out_features, in_features", [(3072, 2048), (2048, 8192), (16384, 2048), (70, 130)])
def test_heuristic_plan_covers_every_input_feature_once(rows, out_features, in_features):
    plan = heuristic_plan(rows, out_features, in_features)
    covered = plan.num_splits * plan.tiles_per_split * plan.block_k
    assert in_features <= covered < in_features + plan.tiles_per_split * plan.block_k  # no empty split
    assert plan.block_m >= 16  # tl.dot's smallest tile
    if plan.num_splits > 1:  # only long rows split, and never below the minimum share
        assert in_features > 4 * MIN_SPLIT_FEATURES
        assert plan.tiles_per_split * plan.block_k >= MIN_SPLIT_FEATURES
    assert heuristic_plan(rows, out_features, in_features) == plan  # shapes only: a graph replays it


def test_tuned_table_serves_its_device_shape_and_row_bucket(monkeypatch):
    tuned = LaunchPlan(16, 32, 256, 1, 8, 4)
    table = load_plans({"GPU X": {"3072x2048": {"16": list(tuned), "256": [64, 128, 64, 1, 32, 8]}}})
    monkeypatch.setattr(triton_int8_linear, "_tuned_table", lambda: table)
    assert launch_plan(9, 3072, 2048, "GPU X") == tuned  # rows 2-16 take the 16-row plan
    assert launch_plan(16, 3072, 2048, "GPU X") == tuned
    assert launch_plan(200, 3072, 2048, "GPU X") == LaunchPlan(64, 128, 64, 1, 32, 8)
    assert launch_plan(17, 3072, 2048, "GPU X") == heuristic_plan(17, 3072, 2048)  # no 32-row entry
    assert launch_plan(9, 3072, 2048, "GPU Y") == heuristic_plan(9, 3072, 2048)  # another device
    assert launch_plan(9, 2048, 2048, "GPU X") == heuristic_plan(9, 2048, 2048)  # another shape
    assert launch_plan(300, 3072, 2048, "GPU X") == heuristic_plan(300, 3072, 2048)  # past the buckets


@pytest.mark.parametrize("fields, bucket", [
    ([16, 32, 256, 1, 7, 4], "16"),  # 7 x 256 features: 1,792 of 2,048 uncovered
    ([16, 32, 256, 3, 4, 4], "16"),  # the third split starts past the last feature
    ([8, 32, 256, 1, 8, 4], "16"),  # 8-row tiles: below tl.dot's 16
    ([16, 32, 256, 1, 8, 4], "24"),  # not a bucket the lookup asks for
])  # fmt: skip
def test_a_tuned_plan_that_does_not_fit_its_shape_is_refused_by_name(fields, bucket):
    with pytest.raises(ValueError, match=rf"'GPU X' 3072x2048 rows<={bucket}"):
        load_plans({"GPU X": {"3072x2048": {bucket: fields}}})


def test_interpreted_kernel_equals_references_on_cpu():
    run_interpreted("tests.engine.triton_int8_linear_checks", "interpreted int8 linear checks passed", "--engine")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_cuda_kernel_equals_fp64_reference(dtype, tolerance):
    from tests.engine.triton_int8_linear_checks import check_exact

    check_exact("cuda", dtype, tolerance)


@pytest.mark.cuda
def test_cuda_dispatch_takes_the_kernel_for_16_bit_decode_rows():
    from engine.layers.int8_matmul import TRITON_MAX_ROWS, select_backend

    for dtype in (torch.bfloat16, torch.float16):
        assert select_backend(torch.zeros(1, 64, device="cuda", dtype=dtype)).name == "triton"
        assert select_backend(torch.zeros(TRITON_MAX_ROWS, 64, device="cuda", dtype=dtype)).name == "triton"
        assert select_backend(torch.zeros(TRITON_MAX_ROWS + 1, 64, device="cuda", dtype=dtype)).name == "dequantize"
    assert select_backend(torch.zeros(1, 64, device="cuda")).name == "dequantize"  # fp32: no tensor cores


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_int8_engine_equals_hf_on_the_dequantized_checkpoint(cuda_graphs, checkpoint, make_llm, tmp_path):
    """fp32 with every matmul forced onto the kernel (graphs captured under it): HF-exact tokens."""
    from engine import SamplingParams
    from tests.engine.triton_int8_linear_checks import triton_backend_forced
    from tests.factories import TinySpec, dequantized_checkpoint, hf_greedy_generate, random_prompts

    model_dir = checkpoint(TinySpec(seed=12))
    reference = dequantized_checkpoint(model_dir, tmp_path / "dequantized", quantize_lm_head=True)
    prompts = random_prompts(6, 1, 90, 512, seed=13)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = hf_greedy_generate(reference, prompts, greedy.max_tokens, device="cuda")
    with triton_backend_forced():
        llm = make_llm(model_dir, device="cuda", cuda_graphs=cuda_graphs, quantization="int8", quantize_lm_head=True)
        assert [list(o.token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
