"""AWQ's activation-aware scale search (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization
for LLM Compression and Acceleration").

Input channels that see large activations matter most; scaling such a channel's weights up by `s`
before rounding (and its input down by `s`, folded into the operation that produces the input: an
RMSNorm's gain or the previous projection's output rows) shrinks their relative rounding error. The
scales are `s = x_mean^alpha / w_mean^(1 - alpha)` (normalized), with `alpha` chosen on a grid to minimise the
squared error of the layers' outputs on calibration inputs, as AutoAWQ searches it. Weight clipping
(AWQ's second search) is not done.
"""

from __future__ import annotations

import torch

from engine.quantization.rtn import rtn_quantize

GRID_POINTS = 20


def fake_quantize(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """weight [out, in] rounded to nearest (asymmetric, per group) and read back."""
    values, scales, zeros = rtn_quantize(weight, bits, group_size, sym=False)
    size = weight.shape[1] if group_size == -1 else group_size
    group = torch.arange(weight.shape[1]) // size
    return (values - zeros[group].t()).float() * scales[group].t()


def search_scales(inputs: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int) -> torch.Tensor:
    """inputs [n, in] shared by `weights` (each [out_k, in]) → per-input-channel scales [in]."""
    inputs = inputs.reshape(-1, inputs.shape[-1]).float()
    weight = torch.cat([w.float() for w in weights])
    size = weight.shape[1] if group_size == -1 else group_size
    grouped = weight.abs().reshape(weight.shape[0], -1, size)
    w_mean = (grouped / (grouped.amax(dim=2, keepdim=True) + 1e-6)).reshape(weight.shape).mean(dim=0)
    x_mean = inputs.abs().mean(dim=0)
    reference = inputs @ weight.t()
    best_loss, best = float("inf"), torch.ones_like(x_mean)
    for step in range(GRID_POINTS):
        ratio = step / GRID_POINTS
        scales = (x_mean.pow(ratio) / w_mean.clamp_min(1e-4).pow(1 - ratio)).clamp_min(1e-4)
        scales = scales / (scales.max() * scales.min()).sqrt()
        approx = fake_quantize(weight * scales, bits, group_size) / scales
        loss = (inputs @ approx.t() - reference).pow(2).mean().item()
        if loss < best_loss:
            best_loss, best = loss, scales
    return best
