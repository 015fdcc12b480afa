"""Packing small unsigned integers into int32 words, the layout GPTQ and AWQ checkpoints share.

A word holds `32 // bits` values; value `k` of a word sits in bits `[k * bits, (k + 1) * bits)`.
GPTQ packs along the input dimension (`qweight` rows) and along output channels (`qzeros`), in natural
order; AWQ's GEMM layout packs along output channels in an interleaved order (`AWQ_ORDER`).
"""

from __future__ import annotations

import torch

WORD_BITS = 32


def values_per_word(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    return WORD_BITS // bits


def pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """values (integers in [0, 2**bits)) → int32 with dimension `dim` shrunk by `32 // bits`.

    `order[k]` names which of a word's consecutive values goes into slot `k` (None: slot k holds value k).
    """
    per_word = values_per_word(bits)
    order = order or tuple(range(per_word))
    moved = values.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % per_word:
        raise ValueError(f"dimension {dim} of size {moved.shape[-1]} is not a multiple of {per_word}")
    if moved.numel() and (moved.min() < 0 or moved.max() >= 1 << bits):
        raise ValueError(f"values must lie in [0, {1 << bits})")
    grouped = moved.reshape(*moved.shape[:-1], -1, per_word)[..., list(order)]
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (grouped << shifts).sum(dim=-1)
    words = torch.where(words >= 1 << 31, words - (1 << WORD_BITS), words)  # two's complement int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `pack`: int32 words → int32 values, dimension `dim` grown by `32 // bits`."""
    per_word = values_per_word(bits)
    order = order or tuple(range(per_word))
    moved = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    slots = (moved[..., None] >> shifts) & ((1 << bits) - 1)
    # Slot k holds value order[k]: put each slot back at its value's position.
    values = torch.empty_like(slots)
    values[..., list(order)] = slots
    return values.reshape(*moved.shape[:-1], -1).to(torch.int32).movedim(-1, dim).contiguous()
