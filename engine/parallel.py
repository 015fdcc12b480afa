"""The one communicator object tensor-parallel layers talk to.

Layers never call torch.distributed directly: they hold a `TensorParallelGroup` and the row-parallel
linear layer is the only place that calls `all_reduce`. A single-rank group is the colocated case.
"""
from __future__ import annotations

import torch


class TensorParallelGroup:
    """rank/size of this process in its TP group; `all_reduce` sums a tensor across ranks in place."""

    def __init__(self, rank: int = 0, size: int = 1, process_group=None):
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
        if size > 1 and process_group is None:
            raise ValueError("a tensor-parallel group of size > 1 needs a torch.distributed process group")
        self.rank = rank
        self.size = size
        self._process_group = process_group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(tensor, group=self._process_group)
        return tensor

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's equal share of `total` items; refuses uneven splits by name."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size


SINGLE_RANK = TensorParallelGroup()
