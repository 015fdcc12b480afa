"""Fused elementwise ops for CUDA in Triton: one launch where PyTorch takes several.

A decode step of a small batch is launch-bound, not bandwidth-bound: RMSNorm is ~7 PyTorch kernels,
RoPE ~3 per tensor, SiLU-and-multiply 2; replayed from a CUDA graph each still costs a couple of
microseconds of GPU time (measured: README, performance). Each op here is one kernel that computes in
fp32 and rounds to the tensor's dtype where HF rounds (the residual sum, the normalized value before
the gain, SiLU's output), so bf16 results stay within rounding of HF's and fp32 stays HF-equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, n_cols, x_row_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)  # HF casts before the gain
    weight = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(
        out_ptr + row * n_cols + cols,
        (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dimension of a CUDA tensor whose rows are contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _rms_norm[(rows.shape[0],)](
        rows, weight, out, rows.shape[1], rows.stride(0), eps, BLOCK=triton.next_power_of_2(rows.shape[1]), num_warps=4
    )
    return out.view(x.shape)


@triton.jit
def _rope(
    x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, token_stride, head_stride, HALF: tl.constexpr, BLOCK: tl.constexpr
):
    token, head = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = x_ptr + token * token_stride + head * head_stride
    x1 = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    # cos / sin rows hold [freqs, freqs]: the first half serves both halves.
    cos = tl.load(cos_ptr + token * 2 * HALF + cols, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * 2 * HALF + cols, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + (token * num_heads + head) * 2 * HALF
    tl.store(out + cols, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF + cols, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin for x [tokens, heads, head_dim] (head_dim contiguous), cos/sin
    [tokens, 1, head_dim] contiguous; returns a contiguous tensor like x."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        _rope[(tokens, heads)](
            x,
            cos,
            sin,
            out,
            heads,
            x.stride(0),
            x.stride(1),
            HALF=dim // 2,
            BLOCK=triton.next_power_of_2(dim // 2),
            num_warps=1,
        )
    return out


@triton.jit
def _silu_mul(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # HF rounds SiLU's output
    tl.store(out_ptr + row * n_cols + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a contiguous [tokens, 2 * size] (gate, then up) → [tokens, size]."""
    tokens, width = gate_up.shape
    out = torch.empty(tokens, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if tokens:
        _silu_mul[(tokens, triton.cdiv(width // 2, block))](gate_up, out, width // 2, BLOCK=block, num_warps=4)
    return out
