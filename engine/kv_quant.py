"""How the paged KV cache stores numbers: the `kv_cache_dtype` formats, a tiny registry.

- `auto`: the model's dtype, stored as computed (no scales): today's exact behaviour.
- `int8`: symmetric int8, one fp32 scale per (token, KV head) for K and for V:
  `x ≈ q * scale`, `scale = max|x| / 127` over the head's `head_dim` values.
- `fp8`: `float8_e4m3fn` with the same per-(token, KV head) fp32 scale, `scale = max|x| / 448`.

Why per token and head, not per block and head (measured in `benchmarks/kv_quant_granularity.py`,
README): a token's scale is fixed when it is written, so a block never re-quantizes what it already
holds when a louder token arrives, and one outlier token cannot coarsen its 15 neighbours. The price
is 4 bytes per (token, head, K/V): at head_dim 64, int8 costs 0.266x the fp32 bytes instead of 0.25x.

Error bounds (tests/engine/test_kv_quant.py checks them): int8 rounds to the nearest of 255 levels,
`|x - x'| <= scale / 2`; fp8 e4m3 keeps 3 mantissa bits, `|x - x'| <= max(|x| / 16, scale / 1024)`
(relative half-ulp for normal values, absolute for subnormals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_TINY = 1e-30  # an all-zero head vector gets this amax (its values dequantize to exact zeros)


@dataclass(frozen=True)
class KVFormat:
    """One storage format. `qmax` None: values are stored as they are, with no scales."""

    name: str  # the resolved name: a model dtype name for `auto`, else the format's own
    storage_dtype: torch.dtype
    qmax: float | None
    kernel_code: int  # how the native decode kernel names this format (engine/kernels)

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    @property
    def scale_bytes(self) -> int:
        return 4 if self.quantized else 0

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, planes: int = 2) -> int:
        """KV bytes of one token over all layers, K and V (`planes` 2) or MLA's latent (1), scales included."""
        element_bytes = torch.empty((), dtype=self.storage_dtype).element_size()
        return planes * num_layers * num_kv_heads * (head_dim * element_bytes + self.scale_bytes)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., head_dim] → (values in storage dtype, fp32 scales [...] or None)."""
        qmax = self.qmax
        if qmax is None:
            return x.to(self.storage_dtype), None
        x = x.float()
        scale = x.abs().amax(dim=-1).clamp_min(_TINY) / qmax
        scaled = x / scale.unsqueeze(-1)
        if self.storage_dtype == torch.int8:
            return scaled.round_().clamp_(-qmax, qmax).to(torch.int8), scale
        return scaled.clamp_(-qmax, qmax).to(self.storage_dtype), scale

    def dequantize(
        self, values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        if scale is None:
            return values.to(dtype)
        return (values.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)

    def describe(self) -> str:
        """Short, stable words for layouts and error messages."""
        if not self.quantized:
            return self.name
        return f"{self.name} (fp32 scale per token and KV head)"


_FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0, 1),
    "fp8": KVFormat("fp8", torch.float8_e4m3fn, 448.0, 2),
}
KV_CACHE_DTYPES = ("auto", *_FORMATS)
_NATIVE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """The format `kv_cache_dtype` names for a model computing in `model_dtype`."""
    if kv_cache_dtype == "auto":
        return KVFormat(_NATIVE_DTYPES[model_dtype], model_dtype, None, 0)
    if kv_cache_dtype not in _FORMATS:
        raise ValueError(f"kv_cache_dtype: must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return _FORMATS[kv_cache_dtype]
