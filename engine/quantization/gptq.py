"""GPTQ checkpoints as AutoGPTQ / GPTQModel write them (`quant_method: gptq`).

Per quantized linear layer with `in` input and `out` output features, `bits` in {4, 8},
`per_word = 32 // bits` and `groups = ceil(in / group_size)` (one group when `group_size` is -1):

- `qweight` int32 [in / per_word, out]: the integer weights packed along the input dimension,
  input `i` in slot `i % per_word` of row `i // per_word`;
- `qzeros` int32 [groups, out / per_word]: zero points packed along output channels;
- `scales` fp16/bf16/fp32 [groups, out];
- `g_idx` int32 [in]: the group of each input feature (with `desc_act` the features were quantized in
  activation order, so groups are not contiguous); absent, it is `i // group_size`.

weight[o, i] = scales[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i]. The zero-point convention is the
format version's (`checkpoint_format`, also spelt `format`): `gptq` (v1, what vLLM and most published
checkpoints use) stores zero - 1, so the stored value is incremented on reading; `gptq_v2` stores the
zero point itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import UnsupportedModelError
from engine.quantization.base import (
    CheckpointFormat,
    GroupQuantized,
    ceil_div,
    config_field,
    expect_dtype,
    expect_shape,
)
from engine.quantization.packing import pack, unpack, values_per_word
from engine.quantization.rtn import rtn_quantize

ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # added to a stored zero point, per checkpoint format version
GROUP_SIZES = (-1, 32, 64, 128)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GptqFormat(CheckpointFormat):
    bits: int
    group_size: int  # -1: one group spans the whole input dimension
    sym: bool
    desc_act: bool
    version: str  # a key of ZERO_OFFSET

    method = "gptq"
    marker_parts = ("qweight", "qzeros", "scales", "g_idx")
    layer_parts = marker_parts

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> GptqFormat:
        version = raw.get("checkpoint_format") or raw.get("format") or "gptq"
        if version not in ZERO_OFFSET:
            raise UnsupportedModelError(
                f"quantization_config.checkpoint_format={version!r} is not supported; supported: {list(ZERO_OFFSET)}"
            )
        return cls(
            bits=config_field(raw, "bits", (4, 8), cls.method),
            group_size=config_field(raw, "group_size", GROUP_SIZES, cls.method),
            sym=config_field(raw, "sym", (True, False), cls.method) if "sym" in raw else True,
            desc_act=config_field(raw, "desc_act", (True, False), cls.method) if "desc_act" in raw else False,
            version=version,
        )

    @property
    def label(self) -> str:
        sym = "sym" if self.sym else "asym"
        act = "-act" if self.desc_act else ""
        return f"gptq-{self.version}-w{self.bits}-g{self.group_size}-{sym}{act}"

    def required_parts(self, present: set[str]) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx") if self.desc_act else ("qweight", "qzeros", "scales")

    def dequantize(self, prefix: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        per_word = values_per_word(self.bits)
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        for part, tensor, dtypes in (
            ("qweight", qweight, (torch.int32,)),
            ("qzeros", qzeros, (torch.int32,)),
            ("scales", scales, SCALE_DTYPES),
        ):
            expect_dtype(f"{prefix}.{part}", tensor, dtypes, f"gptq {part}")
        if qweight.dim() != 2 or scales.dim() != 2:
            raise UnsupportedModelError(f"tensor {prefix}.qweight and .scales must be 2-D")
        in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
        groups = 1 if self.group_size == -1 else ceil_div(in_features, self.group_size)
        why = f"bits={self.bits}, group_size={self.group_size}, {in_features} input features"
        expect_shape(f"{prefix}.scales", scales, (groups, out_features), why)
        expect_shape(f"{prefix}.qzeros", qzeros, (groups, out_features // per_word), why)
        g_idx = parts.get("g_idx")
        if g_idx is None:
            g_idx = self.default_g_idx(in_features)
        expect_shape(f"{prefix}.g_idx", g_idx, (in_features,), why)
        g_idx = g_idx.long()
        if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= groups):
            raise UnsupportedModelError(f"tensor {prefix}.g_idx names groups outside [0, {groups})")
        values = unpack(qweight, self.bits, dim=0).float()  # [in, out]
        zeros = unpack(qzeros, self.bits, dim=1).float() + ZERO_OFFSET[self.version]  # [groups, out]
        weight = (values - zeros[g_idx]) * scales.float()[g_idx]
        return weight.t().contiguous()

    def integer_form(self, prefix: str, parts: dict[str, torch.Tensor]) -> GroupQuantized:
        values = unpack(parts["qweight"], self.bits, dim=0).t()
        in_features = values.shape[1]
        g_idx = parts.get("g_idx")
        if g_idx is not None and torch.equal(g_idx.long(), self.default_g_idx(in_features).long()):
            g_idx = None  # groups in input order, as without act-order
        zeros = unpack(parts["qzeros"], self.bits, dim=1).float() + ZERO_OFFSET[self.version]
        # One group spans the row where the config says -1 or its groups are wider than the row.
        group_size = in_features if self.group_size == -1 or self.group_size > in_features else self.group_size
        return GroupQuantized(prefix, values, parts["scales"].float(), zeros, group_size, self.bits, g_idx)

    def default_g_idx(self, in_features: int) -> torch.Tensor:
        size = in_features if self.group_size == -1 else self.group_size
        return (torch.arange(in_features) // size).to(torch.int32)

    def pack_layer(
        self, values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """values int [out, in] in [0, 2**bits), zeros int [groups, out] (true zero points), scales
        [groups, out], g_idx [in] → the layer's tensors as this format stores them."""
        stored_zeros = zeros.to(torch.int64) - ZERO_OFFSET[self.version]
        if stored_zeros.numel() and stored_zeros.min() < 0:
            raise ValueError(
                f"checkpoint format {self.version} cannot store a zero point below {ZERO_OFFSET[self.version]}"
            )
        return {
            "qweight": pack(values.t(), self.bits, dim=0),
            "qzeros": pack(stored_zeros, self.bits, dim=1),
            "scales": scales.to(torch.float16).contiguous(),
            "g_idx": g_idx.to(torch.int32).contiguous(),
        }

    def rtn_parts(self, weight: torch.Tensor, order: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`order` (a permutation of the input features; act-order) groups them in that order."""
        in_features = weight.shape[1]
        order = torch.arange(in_features) if order is None else order
        min_zero = ZERO_OFFSET[self.version]
        values, scales, zeros = rtn_quantize(weight[:, order], self.bits, self.group_size, self.sym, min_zero)
        return self.pack_layer(values[:, torch.argsort(order)], zeros, scales, self.act_order_g_idx(order))

    def act_order_g_idx(self, order: torch.Tensor) -> torch.Tensor:
        """The group of each input feature when features are grouped in `order`."""
        g_idx = torch.empty_like(order)
        g_idx[order] = self.default_g_idx(order.numel()).to(order.dtype)
        return g_idx

    def config(self) -> dict[str, Any]:
        return {
            "quant_method": self.method,
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "desc_act": self.desc_act,
            "checkpoint_format": self.version,
        }
