"""Weight-only int8 linear layer for CUDA in Triton: `out = x @ (weight * scale)ᵀ` with the int8 weight
widened in registers, so a step reads 1 byte per weight instead of 2 (bf16) or 4 (fp32), and never
writes a widened copy (the `dequantize` backend's cost: read int8, write and re-read the wide weight).

Layout: x [rows, in] (fp32 / bf16 / fp16, contiguous), weight int8 [out, in], scale fp32 [out];
out [rows, out] in x's dtype. int8 values widen exactly into any of those dtypes; the dot accumulates
in fp32 and the per-channel scale multiplies the fp32 sum once, before the single rounding to x's
dtype.

Program (row tile, column tile, split): `BLOCK_M` rows x `BLOCK_N` output channels over a contiguous
share of the input features. A layer with few column tiles and long rows (a down projection) splits
its input features `num_splits` ways to fill the GPU (each split writes fp32 partial sums to a
workspace and `torch.sum` adds them in a fixed order: deterministic, unlike atomics). The plan comes
from a table tuned per GPU model, layer shape and row bucket (`int8_linear_plans.json`, written by
benchmarks/tune_int8_linear.py, as vLLM ships tuned MoE configs), else from a measured heuristic. It
depends on the tensor shapes only, so a CUDA graph captured for a batch size replays it.

Precision: bf16 / fp16 activations take tensor-core dots. fp32 activations take IEEE fp32 dots (no
tf32): exact but off the tensor cores, 0.1-0.7x of widen-then-matmul on an H200, so the engine sends
fp32 models to its `dequantize` backend (engine/layers/int8_matmul.py); fp32 stays for the CPU
interpreter's checks.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 264  # two programs per SM of an H100 (132) keep every SM streaming weights
MIN_SPLIT_FEATURES = 1024  # a split shorter than this pays more for its partial sums than it saves
TUNED_ROWS = (1, 16, 32, 64, 128, 256)  # row buckets a tuned table holds (a plan serves rows up to its bucket)
PLANS_PATH = Path(__file__).with_name("int8_linear_plans.json")


class LaunchPlan(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_splits: int
    tiles_per_split: int
    num_warps: int


def launch_plan(rows: int, out_features: int, in_features: int, device_name: str = "") -> LaunchPlan:
    """The plan for one matmul shape: the tuned table's for this device, shape and row bucket where
    it has one (benchmarks/tune_int8_linear.py writes it), else `heuristic_plan`. Shapes only: a CUDA
    graph captured for a batch size replays the same launch."""
    bucket = next((b for b in TUNED_ROWS if rows <= b), None)
    shapes = _tuned_table().get(device_name, {})
    tuned = None if bucket is None else shapes.get(f"{out_features}x{in_features}", {}).get(bucket)
    return tuned or heuristic_plan(rows, out_features, in_features)


def heuristic_plan(rows: int, out_features: int, in_features: int) -> LaunchPlan:
    """Measured on an H200 (README): up to 64 rows, layers of <= 4096 output channels want narrow
    column tiles (64+ programs) and no split over the input features; long input rows (down
    projections) want splits of >= MIN_SPLIT_FEATURES to fill the GPU."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    long_rows = in_features > 4 * MIN_SPLIT_FEATURES
    narrow = rows <= 64 and out_features <= 4096 and not long_rows
    block_n = 32 if narrow else 64 if rows <= 64 else 128
    block_k = 256 if narrow and rows > 16 else 128 if rows <= 64 else 64
    tiles_k = triton.cdiv(in_features, block_k)
    splits = 1
    if long_rows:
        programs = triton.cdiv(rows, block_m) * triton.cdiv(out_features, block_n)
        splits = max(1, min(in_features // MIN_SPLIT_FEATURES, triton.cdiv(TARGET_PROGRAMS, programs)))
    tiles_per_split = triton.cdiv(tiles_k, splits)
    return LaunchPlan(block_m, block_n, block_k, triton.cdiv(tiles_k, tiles_per_split), tiles_per_split, 4)


@functools.cache
def _tuned_table() -> dict[str, dict[str, dict[int, LaunchPlan]]]:
    """{device name: {"OUTxIN": {row bucket: plan}}}; empty where the file is missing."""
    return load_plans(json.loads(PLANS_PATH.read_text())) if PLANS_PATH.exists() else {}


def load_plans(raw: dict) -> dict[str, dict[str, dict[int, LaunchPlan]]]:
    """The JSON table as plans, each checked by `plan_fits`; ValueError names the entry that fails."""
    table: dict[str, dict[str, dict[int, LaunchPlan]]] = {}
    for device, shapes in raw.items():
        for shape, buckets in shapes.items():
            plans = {int(bucket): LaunchPlan(*fields) for bucket, fields in buckets.items()}
            for bucket, plan in plans.items():
                if not plan_fits(plan, bucket, int(shape.split("x")[1])):
                    raise ValueError(f"int8 linear plan {device!r} {shape} rows<={bucket}: {plan} does not fit")
            table.setdefault(device, {})[shape] = plans
    return table


def plan_fits(plan: LaunchPlan, bucket: int, in_features: int) -> bool:
    """A bucket the lookup asks for, tiles of >= 16 rows (tl.dot's smallest), and splits that cover the
    input features with none empty."""
    share = plan.tiles_per_split * plan.block_k
    return bucket in TUNED_ROWS and plan.block_m >= 16 and in_features <= plan.num_splits * share < in_features + share


@functools.cache
def device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@triton.jit
def _int8_linear(
    x_ptr, w_ptr, scale_ptr, out_ptr, rows, out_features, in_features,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One (row tile, column tile, split): fp32 sums over the split's input features. SPLIT: write
    them unscaled to the workspace `out_ptr` [splits, rows, out]; else scale and store in out's dtype."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = m < rows, n < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * TILES_PER_SPLIT * BLOCK_K
    for tile in range(TILES_PER_SPLIT):
        k = first + tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < in_features
        x = tl.load(x_ptr + m[:, None] * in_features + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :] * in_features + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        if IEEE:  # noqa: SIM108 - Triton JIT code: a constexpr if compiles only its branch
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        offsets = split * rows * out_features + m[:, None] * out_features + n[None, :]
        tl.store(out_ptr + offsets, acc, mask=out_mask)
    else:
        scale = tl.load(scale_ptr + n, mask=n_ok, other=0.0)
        out = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + m[:, None] * out_features + n[None, :], out, mask=out_mask)


@triton.jit
def store_tile(out_ptr, acc, split, rows, out_features, m, n, m_ok, n_ok, SPLIT: tl.constexpr):
    """A tile's fp32 sums: into its split's slice of the workspace (SPLIT), else rounded to out's dtype.
    The epilogue of the kernels whose weights need no per-column scale after the sum (int4, fp8)."""
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + split * rows * out_features + m[:, None] * out_features + n[None, :], acc, mask=out_mask)
    else:
        tl.store(out_ptr + m[:, None] * out_features + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def launch_target(
    plan: LaunchPlan, rows: int, out_features: int, x: torch.Tensor
) -> tuple[tuple[int, int, int], bool, torch.Tensor]:
    """The skinny-matmul kernels' launch grid, whether K is split, and what the kernel writes: the
    output in x's dtype, or one fp32 partial per split (summed by the caller)."""
    grid = (triton.cdiv(rows, plan.block_m), triton.cdiv(out_features, plan.block_n), plan.num_splits)
    split = plan.num_splits > 1
    if split:
        return grid, split, torch.empty(plan.num_splits, rows, out_features, device=x.device, dtype=torch.float32)
    return grid, split, torch.empty(rows, out_features, device=x.device, dtype=x.dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, plan: LaunchPlan | None = None):
    """x [rows, in] → [rows, out] in x's dtype; `plan` overrides `launch_plan` (benchmarks)."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    assert weight.dtype == torch.int8 and weight.shape[1] == in_features and scale.numel() == out_features
    if rows == 0:
        return x.new_empty(0, out_features)
    x, weight, scale = x.contiguous(), weight.contiguous(), scale.reshape(-1).float().contiguous()
    if plan is None:
        name = device_name(x.device.index or 0) if x.is_cuda else ""
        plan = launch_plan(rows, out_features, in_features, name)
    grid, split, target = launch_target(plan, rows, out_features, x)
    _int8_linear[grid](
        x, weight, scale, target, rows, out_features, in_features,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, TILES_PER_SPLIT=plan.tiles_per_split,
        SPLIT=split, IEEE=x.dtype == torch.float32, num_warps=plan.num_warps,
    )  # fmt: skip
    if not split:
        return target
    return (target.sum(dim=0) * scale).to(x.dtype)
