"""What every pre-quantized checkpoint format provides: which tensors of a layer it owns and how they
turn back into that layer's weight.

A quantized linear layer `PREFIX` is stored as several tensors `PREFIX.<part>` (GPTQ: `qweight`,
`qzeros`, `scales`, `g_idx`); the format collects them (engine/quantization/assembly.py) and returns
the dequantized `PREFIX.weight` [out_features, in_features] in fp32, which the model then loads like an
unquantized checkpoint's weight (tensor-parallel slicing included). Every check names the tensor whose
shape or dtype disagrees with the `quantization_config`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

from engine.errors import UnsupportedModelError


class GroupQuantized(NamedTuple):
    """A quantized layer's exact integer form, for weight formats that store it natively (int4 weights,
    engine/layers/quantization.py): weight[o, i] = scales[g, o] * (values[o, i] - zeros[g, o])."""

    name: str  # the layer's prefix in the checkpoint, for error messages
    values: torch.Tensor  # int [out, in] in [0, 2**bits)
    scales: torch.Tensor  # fp32 [groups, out]
    zeros: torch.Tensor  # fp32 [groups, out] (the format's zero-point offset applied)
    group_size: int  # consecutive inputs per group (the whole row where the checkpoint says -1)
    bits: int
    g_idx: torch.Tensor | None  # int [in]: each input's group where groups are not consecutive runs (act-order)

    def in_group_order(self) -> tuple[GroupQuantized, torch.Tensor | None]:
        """This layer with its inputs sorted by group, so that every group is a run of `group_size`
        consecutive inputs, and the permutation that sorted them (None where they were already):
        `x @ weightᵀ == x[:, order] @ sorted_weightᵀ`. exllama serves act-order GPTQ this way."""
        if self.g_idx is None:
            return self, None
        in_features = self.values.shape[1]
        order = torch.argsort(self.g_idx.long(), stable=True)
        if not torch.equal(self.g_idx.long()[order], torch.arange(in_features) // self.group_size):
            raise UnsupportedModelError(
                f"layer {self.name}: its g_idx does not give every group {self.group_size} inputs"
            )
        if torch.equal(order, torch.arange(in_features)):
            return self._replace(g_idx=None), None
        return self._replace(values=self.values[:, order], g_idx=None), order

    def shard_in_group_order(self, columns: torch.Tensor, run_size: int) -> tuple[GroupQuantized, torch.Tensor]:
        """The input features `columns` of an act-order layer (a row-parallel rank's shard) as a layer of
        their own in groups of `run_size` consecutive inputs (a divisor of `group_size`), and the order
        that reads them: `x[:, columns] @ weight[:, columns]ᵀ == pad(x[:, columns])[:, order] @ shardᵀ`,
        where `pad` appends one zero feature. A shard holds parts of groups (g_idx scatters them over the
        inputs), so each group it touches becomes whole runs of `run_size` (each with the group's scale
        and zero point) whose missing inputs read the zero feature (index `len(columns)`)."""
        self.in_group_order()  # every group holds group_size inputs, or it fails naming the layer
        assert self.g_idx is not None and self.group_size % run_size == 0
        group_of = self.g_idx.long()[columns]
        by_group = torch.argsort(group_of, stable=True)
        groups, rank_of, counts = torch.unique(group_of[by_group], return_inverse=True, return_counts=True)
        runs = -(-counts // run_size)  # runs each touched group takes
        first_input, first_slot = torch.cumsum(counts, 0) - counts, (torch.cumsum(runs, 0) - runs) * run_size
        slot = first_slot[rank_of] + torch.arange(columns.numel()) - first_input[rank_of]
        order = torch.full((int(runs.sum()) * run_size,), columns.numel(), dtype=torch.long)
        order[slot] = by_group
        padded = torch.cat([self.values[:, columns], self.values.new_zeros(self.values.shape[0], 1)], dim=1)
        scales, zeros = (t[groups].repeat_interleave(runs, dim=0) for t in (self.scales, self.zeros))
        return self._replace(values=padded[:, order], scales=scales, zeros=zeros, group_size=run_size), order


class Float8Stored(NamedTuple):
    """An FP8 layer as its checkpoint stores it, for weight formats that keep it (CUDA,
    engine/layers/quantization.py): weight[o, i] = e4m3(weight[o, i]) * scale[o // bo, i // bi] with
    (bo, bi) = block_size. Per-tensor scales are one block of the whole weight, per-channel ones [1, in]."""

    name: str  # the layer's prefix in the checkpoint, for error messages
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # fp32 [ceil(out / bo), ceil(in / bi)]
    block_size: tuple[int, int]


class CheckpointFormat(ABC):
    """One `quant_method`, parsed from its `quantization_config`."""

    method: str  # the `quant_method` value this class reads
    marker_parts: tuple[str, ...]  # a prefix holding one of these is a quantized layer
    layer_parts: tuple[str, ...]  # every part a quantized layer may hold (some are read, some only accepted)

    @classmethod
    @abstractmethod
    def from_config(cls, raw: dict[str, Any]) -> CheckpointFormat:
        """Validates the `quantization_config` once; a bad or unsupported key fails naming it."""

    @property
    @abstractmethod
    def label(self) -> str:
        """Short description folded into the model identity (`gptq-gptq-w4-g128-sym`)."""

    @abstractmethod
    def required_parts(self, present: set[str]) -> tuple[str, ...]:
        """The parts a quantized layer must hold, given the ones its checkpoint has."""

    @abstractmethod
    def rtn_parts(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight [out, in] rounded to nearest on this format's grid, as the format stores the layer."""

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The `quantization_config` this format is read from."""

    @abstractmethod
    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The layer's fp32 weight [out_features, in_features]."""

    def integer_form(self, prefix: str, parts: dict[str, torch.Tensor]) -> GroupQuantized | None:
        """The layer as integers and group scales, where the format stores it that way (after `dequantize`
        has validated the parts)."""
        return None

    def float8_form(self, prefix: str, parts: dict[str, torch.Tensor]) -> Float8Stored | None:
        """The layer as e4m3 weights and block scales, where the format stores it that way (after
        `dequantize` has validated the parts)."""
        return None


def config_field(raw: dict[str, Any], key: str, allowed: tuple, method: str, *aliases: str) -> Any:
    """`raw[key]` (or its first present alias), which must be one of `allowed`."""
    for name in (key, *aliases):
        if name in raw:
            value = raw[name]
            if value not in allowed:
                raise UnsupportedModelError(
                    f"quantization_config.{name}={value!r} is not supported for {method}; supported: {list(allowed)}"
                )
            return value
    raise UnsupportedModelError(f"quantization_config of {method} lacks {key!r}")


def expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], why: str) -> None:
    if tuple(tensor.shape) != shape:
        raise UnsupportedModelError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shape} ({why})")


def expect_dtype(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...], why: str) -> None:
    if tensor.dtype not in dtypes:
        raise UnsupportedModelError(f"tensor {name} has dtype {tensor.dtype}, expected one of {list(dtypes)} ({why})")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
