"""Multi-head latent attention (DeepSeek-V2/V3) over a latent paged cache.

The cache stores, per token and layer, one vector shared by every head: the normalized KV latent
(`kv_lora_rank`) followed by the rotated RoPE key (`qk_rope_head_dim`): `latent_dim` values instead of
`2 x heads x head_dim` (engine/kv_storage.py `LatentKV`; quantized formats keep one scale per token).
Attention expands the latents it reads back into per-head keys and values with `kv_b_proj`, as HF
computes it, so fp32 greedy tokens match HF's on every path (prefill, decode, prefix hits, hand-offs).

Under tensor parallelism the heads are split (q, kv_b and o projections column/row-parallel) and the
latent is replicated: every rank computes and stores the whole latent, so a decode rank receives the
full cache of a hand-off (the KV "heads" of the layout are one, which every rank holds).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, attend_after_context
from engine.config import MLAConfig, ModelConfig
from engine.kv_storage import KVCacheStorage
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.quantization import linear_method
from engine.layers.rotary import RotaryEmbedding, yarn_mscale
from engine.parallel import TensorParallelGroup

_LORA_NORM_EPS = 1e-6  # HF's q_a / kv_a RMSNorms take their default eps, not the config's rms_norm_eps


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ..., each rotated by one frequency; the rotated
    pairs come out de-interleaved (evens then odds), as HF's DeepSeek-V3 lays them out. Queries and keys
    get the same permutation, so their dot products are RoPE's."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, quantization: str):
        super().__init__()
        mla = cfg.mla
        assert mla is not None, "MLAttention needs the checkpoint's MLA config"
        self.mla: MLAConfig = mla
        dtype, hidden = cfg.torch_dtype, cfg.hidden_size
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = 1  # the latent: one cache "head", replicated on every rank
        q_out = cfg.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj: ColumnParallelLinear | None = ColumnParallelLinear(
                hidden, q_out, False, dtype, tp, linear_method(quantization)
            )
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, dtype, linear_method(quantization))
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LORA_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_out, False, dtype, tp, linear_method(quantization))
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.latent_dim, dtype, linear_method(quantization))
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LORA_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank,
            cfg.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            False,
            dtype,
            tp,
            linear_method(quantization),
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * mla.v_head_dim, hidden, False, dtype, tp, linear_method(quantization)
        )
        self.scale = mla.qk_head_dim**-0.5
        if cfg.rope.rope_type == "yarn" and cfg.rope.mscale_all_dim:  # as HF's DeepSeek attention scales it
            self.scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
        self.rotate = rotate_interleaved if mla.rope_interleave else RotaryEmbedding.rotate

    def forward(self, rope, hidden, kv_cache: KVCacheStorage, index: int, meta: AttentionMetadata) -> torch.Tensor:
        mla = self.mla
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(-1, self.num_heads, mla.qk_head_dim)
        q_nope, q_rot = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        kv_latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k_rot = self.rotate(k_rot.unsqueeze(1), *rope).squeeze(1)
        entries = torch.cat([self.kv_a_layernorm(kv_latent), k_rot], dim=-1)  # [tokens, latent_dim]
        queries = torch.cat([q_nope, self.rotate(q_rot, *rope)], dim=-1)  # [tokens, heads, qk_head_dim]
        cache = kv_cache.latent(index)
        cache.write(entries, meta.slot_mapping)
        out = torch.empty(q.shape[0], self.num_heads, mla.v_head_dim, dtype=q.dtype, device=q.device)
        n_dec = meta.num_decode_tokens
        if n_dec:
            slots, padding = meta.decode_slots, meta.decode_padding_mask
            assert slots is not None and padding is not None, "MLA decode reads the padded slots"
            keys, values = self._expand(cache.read(slots, q.dtype))  # [batch, heads, context, dim]
            scores = torch.matmul(queries[:n_dec].unsqueeze(2), keys.transpose(-1, -2)) * self.scale
            scores.masked_fill_(padding[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[:n_dec] = torch.matmul(probs, values).squeeze(2)
        for seg in meta.prefills:
            rows = slice(seg.query_start, seg.query_start + seg.query_len)
            # A chunk with no earlier context attends to its own fresh latents (as unquantized).
            context = entries[rows] if seg.context_slots is None else cache.read(seg.context_slots, q.dtype)
            keys, values = self._expand(context.unsqueeze(0))
            attended = attend_after_context(queries[rows].transpose(0, 1).unsqueeze(0), keys, values, self.scale)
            out[rows] = attended.squeeze(0).transpose(0, 1)
        return self.o_proj(out.view(q.shape[0], self.num_heads * mla.v_head_dim))

    def _expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latents [batch, context, latent_dim] → keys [batch, heads, context, qk_head_dim] and
        values [batch, heads, context, v_head_dim] of this rank's heads."""
        mla = self.mla
        batch, context, _ = latents.shape
        kv_latent, k_rot = latents.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(kv_latent).view(batch, context, self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, values = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_rot = k_rot.unsqueeze(2).expand(batch, context, self.num_heads, mla.qk_rope_head_dim)
        keys = torch.cat([k_nope, k_rot], dim=-1)
        return keys.transpose(1, 2), values.transpose(1, 2)
