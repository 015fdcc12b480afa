"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize a linear layer's weight one input column at a time, spreading each column's
rounding error over the columns not yet quantized, weighted by the inverse Hessian of the layer's
reconstruction loss.

The Hessian is `H = 2 Xᵀ X / n` over the layer's calibration inputs X [n, in] (`HessianAccumulator`).
`solve` follows the paper's algorithm: dampen H's diagonal, take the upper Cholesky factor of H⁻¹, then
process columns in lazy batches of `block_size` (updates inside a batch are immediate, the batch's
accumulated error reaches later columns in one matmul). With act-order the columns are processed in
order of decreasing Hessian diagonal and the groups follow that order (`g_idx`). Each group's grid is
taken from the (already updated) weights of its columns when its first column is reached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quantization.rtn import group_grid, round_to_grid


class HessianAccumulator:
    """Running `2 Xᵀ X / n` over batches of a layer's inputs, in float64 for a stable Cholesky later."""

    def __init__(self, in_features: int):
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.num_rows = 0

    def add(self, inputs: torch.Tensor) -> None:
        rows = inputs.reshape(-1, inputs.shape[-1]).double()
        total = self.num_rows + rows.shape[0]
        self.hessian.mul_(self.num_rows / total).add_(rows.t() @ rows, alpha=2.0 / total)
        self.num_rows = total


@dataclass(frozen=True)
class GptqResult:
    values: torch.Tensor  # int64 [out, in], input features in their original order
    scales: torch.Tensor  # fp32 [groups, out]
    zeros: torch.Tensor  # int64 [groups, out]
    g_idx: torch.Tensor  # int32 [in]


def solve(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    act_order: bool,
    min_zero: int = 0,
    damp_fraction: float = 0.01,
    block_size: int = 128,
) -> GptqResult:
    """weight [out, in] and its Hessian [in, in] → the quantized layer."""
    weight = weight.double().clone()
    hessian = hessian.double().clone()
    out_features, in_features = weight.shape
    dead = hessian.diagonal() == 0  # inputs never active: any value is exact, quantize them as zero
    hessian[dead, dead] = 1.0
    weight[:, dead] = 0.0
    order = torch.argsort(hessian.diagonal(), descending=True) if act_order else torch.arange(in_features)
    weight, hessian = weight[:, order], hessian[order][:, order]
    hessian.diagonal().add_(damp_fraction * hessian.diagonal().mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)

    group = in_features if group_size == -1 else group_size
    values = torch.zeros(out_features, in_features, dtype=torch.int64)
    scales, zeros = [], []
    scale = zero = torch.empty(0)
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        block, errors, hinv_block = (
            weight[:, start:end].clone(),
            torch.zeros(out_features, end - start, dtype=torch.float64),
            hinv[start:end, start:end],
        )
        for offset in range(end - start):
            column = start + offset
            if column % group == 0:
                grid_of = torch.cat([block[:, offset:], weight[:, end:]], dim=1)[:, :group]
                scale, zero = group_grid(grid_of, bits, sym, min_zero)
                scales.append(scale)
                zeros.append(zero)
            w = block[:, offset]
            q = round_to_grid(w[:, None], scale, zero, bits)[:, 0]
            values[:, column] = q
            dequantized = scale.double() * (q - zero).double()
            error = (w - dequantized) / hinv_block[offset, offset]
            block[:, offset:] -= error[:, None] * hinv_block[offset, offset:][None, :]
            errors[:, offset] = error
        weight[:, end:] -= errors @ hinv[start:end, end:]

    inverse = torch.argsort(order)
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group).to(torch.int32)
    return GptqResult(values[:, inverse], torch.stack(scales), torch.stack(zeros), g_idx)
