"""AWQ checkpoints in AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`).

Per quantized linear layer with `in` input and `out` output features and `groups = in / group_size`:

- `qweight` int32 [in, out / 8]: 4-bit weights packed along output channels; the word for outputs
  `8c .. 8c + 7` holds output `8c + AWQ_ORDER[k]` in slot `k` (bits `4k .. 4k + 3`);
- `qzeros` int32 [groups, out / 8]: zero points, packed the same way, stored as they are (no offset);
- `scales` fp16/bf16 [groups, out].

weight[o, i] = scales[g, o] * (q[i, o] - zero[g, o]) with g = i // group_size. AWQ's scale search folds
the activation-aware per-channel scales into the weights before they are stored, so nothing else
is needed to read them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import UnsupportedModelError
from engine.quantization.base import CheckpointFormat, GroupQuantized, config_field, expect_dtype, expect_shape
from engine.quantization.packing import pack, unpack
from engine.quantization.rtn import rtn_quantize

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # slot k of a packed word holds output AWQ_ORDER[k] of its eight
BITS = 4
PER_WORD = 8
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AwqFormat(CheckpointFormat):
    group_size: int

    method = "awq"
    marker_parts = ("qweight", "qzeros", "scales")
    layer_parts = marker_parts

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> AwqFormat:
        config_field(raw, "bits", (BITS,), cls.method, "w_bit")
        config_field(raw, "version", ("gemm", "GEMM"), cls.method)
        if "zero_point" in raw:
            config_field(raw, "zero_point", (True,), cls.method)
        return cls(group_size=config_field(raw, "group_size", (64, 128), cls.method, "q_group_size"))

    @property
    def label(self) -> str:
        return f"awq-gemm-w{BITS}-g{self.group_size}"

    def required_parts(self, present: set[str]) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        for part, tensor, dtypes in (
            ("qweight", qweight, (torch.int32,)),
            ("qzeros", qzeros, (torch.int32,)),
            ("scales", scales, SCALE_DTYPES),
        ):
            expect_dtype(f"{prefix}.{part}", tensor, dtypes, f"awq {part}")
        if qweight.dim() != 2:
            raise UnsupportedModelError(f"tensor {prefix}.qweight must be 2-D")
        in_features, out_features = qweight.shape[0], qweight.shape[1] * PER_WORD
        if in_features % self.group_size:
            raise UnsupportedModelError(
                f"tensor {prefix}.qweight has {in_features} input features, "
                f"not a multiple of group_size={self.group_size}"
            )
        groups = in_features // self.group_size
        why = f"group_size={self.group_size}, {in_features} input features, {out_features} outputs"
        expect_shape(f"{prefix}.scales", scales, (groups, out_features), why)
        expect_shape(f"{prefix}.qzeros", qzeros, (groups, out_features // PER_WORD), why)
        values = unpack(qweight, BITS, dim=1, order=AWQ_ORDER).float()  # [in, out]
        zeros = unpack(qzeros, BITS, dim=1, order=AWQ_ORDER).float()  # [groups, out]
        group = torch.arange(in_features) // self.group_size
        weight = (values - zeros[group]) * scales.float()[group]
        return weight.t().contiguous()

    def integer_form(self, prefix: str, parts: dict[str, torch.Tensor]) -> GroupQuantized:
        values = unpack(parts["qweight"], BITS, dim=1, order=AWQ_ORDER).t()
        zeros = unpack(parts["qzeros"], BITS, dim=1, order=AWQ_ORDER).float()
        return GroupQuantized(prefix, values, parts["scales"].float(), zeros, self.group_size, BITS, None)

    def pack_layer(self, values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
        """values int [out, in] in [0, 16), zeros int [groups, out], scales [groups, out] → the layer's
        tensors as AutoAWQ's GEMM layout stores them."""
        return {
            "qweight": pack(values.t(), BITS, dim=1, order=AWQ_ORDER),
            "qzeros": pack(zeros, BITS, dim=1, order=AWQ_ORDER),
            "scales": scales.to(torch.float16).contiguous(),
        }

    def rtn_parts(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        values, scales, zeros = rtn_quantize(weight, BITS, self.group_size, sym=False)
        return self.pack_layer(values, zeros, scales)

    def config(self) -> dict[str, Any]:
        return {
            "quant_method": self.method,
            "bits": BITS,
            "group_size": self.group_size,
            "zero_point": True,
            "version": "gemm",
        }
