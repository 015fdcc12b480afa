"""The gated feed-forward block (SiLU(x·Wg) ⊙ x·Wu)·Wd, tensor-parallel: gate and up fused into one
column-parallel matmul, down row-parallel (the one all-reduce)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.layers.quantization import QuantizationSpec, linear_method
from engine.parallel import TensorParallelGroup


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: TensorParallelGroup,
        quantization: QuantizationSpec,
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], False, dtype, tp, linear_method(quantization)
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, False, dtype, tp, linear_method(quantization)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel instead of two (engine/kernels/triton_fused.py)
            from engine.kernels.triton_fused import silu_mul

            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))
