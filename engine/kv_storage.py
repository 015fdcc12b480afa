"""The paged KV cache's storage on one rank: values and (for quantized formats) scales, in one object.

Layout: values `[num_layers, planes, kv_heads, num_blocks, block_size, head_dim]` in the format's
storage dtype; scales `[num_layers, planes, kv_heads, num_blocks, block_size]` fp32 (one per token and KV
head), or None. `planes` is 2 (K and V) for per-head attention; MLA stores one latent vector per token
(`planes` 1, one "head" of `kv_lora_rank + qk_rope_head_dim`), read through `latent(i)`.
Heads lead so one KV head's blocks are contiguous: a decode TP rank receives whole
head slices. Attention reads it through `layer(i)`; everything that moves KV between processes
(kvtransfer, prefill and decode workers) uses only the transfer methods below, never the tensors, so
the blocks and their scales travel as stored: no dequantize, no requantize.

Per-layer transfer message: `[values [planes, heads, blocks, block_size, head_dim]]`, plus
`scales [planes, heads, blocks, block_size]` for quantized formats. `layout` names the format and shape, so
two sides can compare before any byte moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.kv_quant import KVFormat


class LayerKV(NamedTuple):
    """One layer's cache: K and V values `[kv_heads, num_blocks, block_size, head_dim]` and their
    scales `[kv_heads, num_blocks, block_size]` (None when the format has none)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    fmt: KVFormat

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new keys/values `[tokens, kv_heads, head_dim]` (quantized as the format says)."""
        for cache, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            values, scale = self.fmt.quantize(new)
            heads, blocks, block_size, dim = cache.shape
            flat = _wide(cache.view(heads, blocks * block_size, dim))
            flat.index_copy_(1, slot_mapping, _wide(values.transpose(0, 1)))
            if scales is not None and scale is not None:  # both or neither: the format decides
                scales.view(heads, blocks * block_size).index_copy_(1, slot_mapping, scale.transpose(0, 1))


class LatentKV(NamedTuple):
    """One layer's MLA cache: latent values `[num_blocks, block_size, latent_dim]` and their scales
    `[num_blocks, block_size]` (None when the format has none)."""

    values: torch.Tensor
    scales: torch.Tensor | None
    fmt: KVFormat

    def write(self, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new latents `[tokens, latent_dim]` (quantized as the format says)."""
        values, scale = self.fmt.quantize(latent)
        blocks, block_size, dim = self.values.shape
        _wide(self.values.view(blocks * block_size, dim)).index_copy_(0, slot_mapping, _wide(values))
        if self.scales is not None and scale is not None:
            self.scales.view(-1).index_copy_(0, slot_mapping, scale)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The latents at `slots` (any shape) as `[*slots.shape, latent_dim]` in `dtype`, dequantized."""
        blocks, block_size, dim = self.values.shape
        flat = slots.reshape(-1)
        values = _bytes(self.values.view(blocks * block_size, dim)).index_select(0, flat)
        values = values.view(self.fmt.storage_dtype)
        scales = None if self.scales is None else self.scales.view(-1).index_select(0, flat)
        return self.fmt.dequantize(values, scales, dtype).view(*slots.shape, dim)


class KVCacheStorage:
    def __init__(
        self,
        fmt: KVFormat,
        num_layers: int,
        num_kv_heads: int,
        num_blocks: int,
        block_size: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        planes: int = 2,
    ):
        self.fmt = fmt
        self.num_layers, self.num_kv_heads, self.num_blocks = num_layers, num_kv_heads, num_blocks
        self.block_size, self.head_dim, self.planes = block_size, head_dim, planes
        shape = (num_layers, planes, num_kv_heads, num_blocks, block_size)
        self.values = torch.zeros(*shape, head_dim, dtype=fmt.storage_dtype, device=device)
        self.scales = torch.zeros(shape, dtype=torch.float32, device=device) if fmt.quantized else None
        # Every layer's views, made once: a decode step asks for each layer's, and four tensor selects
        # per layer per step are a measurable share of a small model's batch-1 step on CPU.
        self._layers = tuple(self._layer_views(index) for index in range(num_layers)) if planes == 2 else ()

    def layer(self, index: int) -> LayerKV:
        assert self.planes == 2, "an MLA cache is read through latent()"
        return self._layers[index]

    def _layer_views(self, index: int) -> LayerKV:
        scales = self.scales
        return LayerKV(
            self.values[index, 0],
            self.values[index, 1],
            None if scales is None else scales[index, 0],
            None if scales is None else scales[index, 1],
            self.fmt,
        )

    def latent(self, index: int) -> LatentKV:
        assert self.planes == 1 and self.num_kv_heads == 1, "a K/V cache is read through layer()"
        scales = self.scales
        return LatentKV(self.values[index, 0, 0], None if scales is None else scales[index, 0, 0], self.fmt)

    # ---- sizes and identity ---------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """This rank's KV bytes for one token (all layers, K and V or the latent, scales included)."""
        return self.fmt.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.planes)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def layout(self) -> str:
        """What both ends of a KV transfer must agree on, in words: format, block size, head_dim,
        layers. (KV heads are not in it: a decode TP rank holds a slice of the sender's heads.)"""
        kind = "" if self.planes == 2 else "mla latent "
        return (
            f"{kind}kv {self.fmt.describe()}, block_size {self.block_size}, head_dim {self.head_dim}, "
            f"layers {self.num_layers}"
        )

    # ---- transfer -------------------------------------------------------------------------------
    def export_layer(self, layer: int, head_start: int, head_end: int, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """Layer `layer`'s KV heads [head_start, head_end) of `block_ids` (int64), as sent."""
        heads = slice(head_start, head_end)
        block_ids = block_ids.to(self.values.device)
        out = [_bytes(self.values[layer, :, heads]).index_select(2, block_ids).view(self.fmt.storage_dtype)]
        if self.scales is not None:
            out.append(self.scales[layer, :, heads].index_select(2, block_ids))
        return out

    def staging(self, num_blocks: int) -> list[torch.Tensor]:
        """Empty tensors one received layer fills (this rank's heads; a message carries one or more layers)."""
        shape = (self.planes, self.num_kv_heads, num_blocks, self.block_size)
        out = [torch.empty(*shape, self.head_dim, dtype=self.fmt.storage_dtype, device=self.values.device)]
        if self.scales is not None:
            out.append(torch.empty(shape, dtype=torch.float32, device=self.values.device))
        return out

    def import_layer(self, layer: int, block_ids: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Writes one received layer (`staging` shapes) into `block_ids` of layer `layer`."""
        block_ids = block_ids.to(self.values.device)
        _wide(self.values[layer]).index_copy_(2, block_ids, _wide(tensors[0]))
        if self.scales is not None:
            self.scales[layer].index_copy_(2, block_ids, tensors[1])

    def copy_blocks_from(self, other: KVCacheStorage, source: Sequence[int], target: Sequence[int]) -> None:
        """Every layer's KV of `other`'s blocks `source` into our blocks `target` (same layout and heads)."""
        src, dst = (torch.tensor(list(ids), dtype=torch.int64, device=self.values.device) for ids in (source, target))
        for layer in range(self.num_layers):
            self.import_layer(layer, dst, other.export_layer(layer, 0, other.num_kv_heads, src))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an fp8 tensor (which has no index_copy on CPU); other tensors as they are."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes with elements as wide as its rows allow (8, 4 or 2 bytes), for `index_copy_`,
    which moves elements one at a time: a 512-token int8 write ran 4.4x faster through an int64 view,
    bf16 1.4x (measured on CPU; 4-byte dtypes gained nothing and stay as they are). Bit-exact. torch's
    `view(dtype)` itself refuses a view the strides, the row or the offset do not allow."""
    if tensor.element_size() >= 4:
        return tensor
    for wide in (torch.int64, torch.int32, torch.int16):
        if wide.itemsize > tensor.element_size():
            try:
                return tensor.view(wide)
            except RuntimeError:  # rows or offset not a whole number of `wide` elements
                continue
    return _bytes(tensor)
