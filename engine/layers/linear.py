"""Tensor-parallel linear layers that own their sharding.

Column-parallel layers split the output features across ranks, row-parallel layers split the input
features and are the only place that all-reduces. Each parameter carries a `weight_loader` that takes
the full checkpoint tensor and keeps this rank's slice, so loading needs no knowledge of TP.
How the weight is stored and multiplied (fp, int8) is the layer's `LinearMethod`
(engine/layers/quantization.py); `scale_loader` keeps this rank's slice of per-output-channel scales.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.quantization import LinearMethod, Unquantized
from engine.parallel import SINGLE_RANK, TensorParallelGroup


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's rows (output features) split evenly across ranks; no communication."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallelGroup = SINGLE_RANK,
        method: LinearMethod | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.method = method or Unquantized()
        self.output_size_local = tp.shard(output_size, "output_size")
        self.method.create_weights(self, self.output_size_local, input_size, dtype)
        self.bias = _param(self.output_size_local, dtype=dtype) if bias else None
        if self.bias is not None:
            # The loader rides on the Parameter (model_loader calls it); torch does not declare the attribute.
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * size, size))

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self.weight_loader(param, loaded, shard_id)  # output channels: sliced like the weight's rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate + up)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallelGroup = SINGLE_RANK,
        method: LinearMethod | None = None,
    ):
        self.output_sizes_local = [tp.shard(size, "output_size") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, dtype, tp, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        size = self.output_sizes_local[shard_id]
        offset = sum(self.output_sizes_local[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by attention head. When there are fewer KV heads than ranks, each
    KV head is replicated on tp_size / num_kv_heads ranks (MQA/GQA under wide TP)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallelGroup = SINGLE_RANK,
        method: LinearMethod | None = None,
    ):
        self.head_dim = head_dim
        self.num_heads_local = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads_local = tp.shard(num_kv_heads, "num_key_value_heads")
        else:
            tp.shard(tp.size, "tensor-parallel size")  # no-op check
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"tensor-parallel size {tp.size} is not a multiple of num_key_value_heads {num_kv_heads}"
                )
            self.num_kv_heads_local = 1
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        total_local = (self.num_heads_local + 2 * self.num_kv_heads_local) * head_dim
        super().__init__(hidden_size, total_local * tp.size, bias, dtype, tp, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size = self.num_heads_local * self.head_dim
        kv_size = self.num_kv_heads_local * self.head_dim
        if shard_id == "q":
            offset, size, rank_index = 0, q_size, self.tp.rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank_index = kv_size, self.tp.rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank_index * size, size))


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's columns (input features) split across ranks; partial sums are all-reduced
    here, and the bias is added once after the reduction."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TensorParallelGroup = SINGLE_RANK,
        method: LinearMethod | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.method = method or Unquantized()
        self.input_size_local = tp.shard(input_size, "input_size")
        self.method.create_weights(self, output_size, self.input_size_local, dtype)
        self.bias = _param(output_size, dtype=dtype) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = lambda param, loaded, shard_id=None: param.data.copy_(loaded)  # type: ignore[attr-defined]  # as above

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * size, size))

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)  # every rank holds every output channel (of its input slice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.method.apply(self, x))
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(nn.Module):
    """y = x Wᵀ with the whole weight on every rank (the LM head)."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype, method: LinearMethod | None = None):
        super().__init__()
        self.method = method or Unquantized()
        self.method.create_weights(self, output_size, input_size, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    scale_loader = weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)
