"""Round-to-nearest group quantization: the grid (scale, zero point) of each group of input features,
and the integers a weight rounds to on it. GPTQ and AWQ (splitserve/quantize) choose the weights or
scales they round; this module does the rounding they share.

Asymmetric groups span [min, max] of the group (`maxq = 2**bits - 1` steps, zero = round(-min / scale));
symmetric groups span [-absmax, absmax] with the zero point fixed at `(maxq + 1) / 2`, as GPTQ does.
"""

from __future__ import annotations

import torch

MIN_SCALE = 1e-4


def group_grid(weight: torch.Tensor, bits: int, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., n] (groups of n input features) → (scale [...], zero [...], int64).

    `min_zero` raises an asymmetric zero point that would fall below it (a format that stores zero - 1
    cannot store zero 0) by widening the grid's negative side instead."""
    maxq = (1 << bits) - 1
    weight = weight.float()
    if sym:
        absmax = weight.abs().amax(dim=-1)
        return _stored(absmax * 2 / maxq), torch.full(absmax.shape, (maxq + 1) // 2, dtype=torch.int64)
    low = weight.amin(dim=-1).clamp(max=0)
    high = weight.amax(dim=-1).clamp(min=0)
    scale = _stored((high - low) / maxq)
    zero = torch.round(-low / scale).clamp(min_zero, maxq).to(torch.int64)
    # A raised zero point shifts the grid up: widen the step so the largest value still fits.
    scale = torch.maximum(scale, _stored(high / (maxq - zero).clamp_min(1)))
    return scale, zero


def _stored(scale: torch.Tensor) -> torch.Tensor:
    # Checkpoints store scales in fp16: round with the scale that will be read back. The floor keeps
    # an all-zero group's scale a normal fp16 number.
    return scale.clamp_min(MIN_SCALE).to(torch.float16).float()


def round_to_grid(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """weight [..., n] with scale / zero [...] → integers [..., n] in [0, 2**bits)."""
    maxq = (1 << bits) - 1
    return (torch.round(weight.float() / scale[..., None]) + zero[..., None]).clamp(0, maxq).to(torch.int64)


def rtn_quantize(
    weight: torch.Tensor, bits: int, group_size: int, sym: bool, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] → (values [out, in], scales [groups, out], zeros [groups, out]) with groups of
    `group_size` consecutive input features (-1, or more than the row: one group)."""
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 or group_size > in_features else group_size
    if in_features % size:
        raise ValueError(f"{in_features} input features do not split into groups of {size}")
    groups = weight.reshape(out_features, in_features // size, size)
    scale, zero = group_grid(groups, bits, sym, min_zero)
    values = round_to_grid(groups, scale, zero, bits).reshape(out_features, in_features)
    return values, scale.t().contiguous(), zero.t().contiguous()
