"""Collecting a quantized layer's tensors, which may arrive in any order and from several shards, and
handing the model its dequantized `weight` once the last one is read."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.errors import UnsupportedModelError
from engine.quantization.base import CheckpointFormat

# Dtypes that only quantized layers store: one outside a layer the format reads is a checkpoint the
# format does not describe, never a tensor to cast into the model.
PACKED_DTYPES = (torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)


class WeightAssembler:
    """`feed(name, tensor)` yields what the model loads: ordinary tensors as they are, and
    `PREFIX.weight` (fp32) once every part of quantized layer `PREFIX` has been fed, carrying the
    layer's integer form as its `group_quantized` attribute and its e4m3 form as `float8_form` (None
    where the format has none)."""

    def __init__(self, fmt: CheckpointFormat | None, names: Iterable[str]):
        self.fmt = fmt
        self.layers: dict[str, set[str]] = {}  # prefix → the parts the checkpoint has
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        if fmt is not None:
            self.layers = _quantized_layers(fmt, names)
            if not self.layers:
                raise UnsupportedModelError(
                    f"quantization_config says {fmt.method}, but no tensor ends in any of "
                    f"{['.' + p for p in fmt.marker_parts]}"
                )

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        prefix, _, part = name.rpartition(".")
        if self.fmt is None or part not in self.layers.get(prefix, ()):
            if tensor.dtype in PACKED_DTYPES:
                method = self.fmt.method if self.fmt else "none"
                raise UnsupportedModelError(
                    f"tensor {name} has dtype {tensor.dtype}, which the checkpoint's quantization ({method}) "
                    "does not describe"
                )
            yield name, tensor
            return
        parts = self.pending.setdefault(prefix, {})
        parts[part] = tensor
        if set(parts) == self.layers[prefix]:
            del self.pending[prefix]
            weight = self.fmt.dequantize(prefix, parts)
            # Weight formats that store integers natively (int4) read this instead of re-rounding the weight.
            weight.group_quantized = self.fmt.integer_form(prefix, parts)  # type: ignore[attr-defined]
            # Weight formats that keep e4m3 weights (fp8 on CUDA) read this instead of the widened weight.
            weight.float8_form = self.fmt.float8_form(prefix, parts)  # type: ignore[attr-defined]
            yield f"{prefix}.weight", weight


def _quantized_layers(fmt: CheckpointFormat, names: Iterable[str]) -> dict[str, set[str]]:
    present: dict[str, set[str]] = {}
    for name in names:
        prefix, _, part = name.rpartition(".")
        if part in fmt.layer_parts:
            present.setdefault(prefix, set()).add(part)
    layers = {prefix: parts for prefix, parts in present.items() if parts & set(fmt.marker_parts)}
    for prefix, parts in sorted(layers.items()):
        missing = [part for part in fmt.required_parts(parts) if part not in parts]
        if missing:
            raise UnsupportedModelError(f"quantized layer {prefix} ({fmt.method}) lacks tensor {prefix}.{missing[0]}")
    return layers
