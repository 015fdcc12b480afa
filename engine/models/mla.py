"""Multi-head latent attention (DeepSeek-V2/V3) over a latent paged cache.

The cache stores, per token and layer, one vector shared by every head: the normalized KV latent
(`kv_lora_rank`) followed by the rotated RoPE key (`qk_rope_head_dim`): `latent_dim` values instead of
`2 x heads x head_dim` (engine/kv_storage.py `LatentKV`; quantized formats keep one scale per token).
Attention expands the latents it reads back into per-head keys and values with `kv_b_proj`, as HF
computes it, so fp32 greedy tokens match HF's on every path (prefill, decode, prefix hits, hand-offs).
With `mla_absorbed_decode` (the default), decode rows instead attend over the latents themselves,
kv_b's key half folded into the query and its value half into the output (`_absorbed_attention`): the
same products summed in another order, so fp32 outputs move by rounding only (the stated bound: 1e-5
of the largest output per layer) and greedy tokens still match HF's. It is faster at every measured
shape (docs/performance.md); prefill chunks, compute-bound and long, always expand.

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
from engine.layers.quantization import QuantizationSpec, linear_method
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
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, quantization: QuantizationSpec):
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
        # Decode attends over the latents directly, kv_b's halves folded into the query and the output
        # (`set_absorbed_decode`, on by the engine's default); the folded weights are made on the first such step.
        self.absorbed_decode = True
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

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
            latents = cache.read(slots, q.dtype)  # [batch, context, latent_dim]
            attend = self._absorbed_attention if self.absorbed_decode else self._expanded_attention
            out[:n_dec] = attend(queries[:n_dec], latents, padding)
        for seg in meta.prefills:
            rows = slice(seg.query_start, seg.query_start + seg.query_len)
            # A chunk with no earlier context attends to its own fresh latents (as unquantized).
            context = entries[rows] if seg.context_slots is None else cache.read(seg.context_slots, q.dtype)
            keys, values = self._expand(context.unsqueeze(0))
            attended = attend_after_context(queries[rows].transpose(0, 1).unsqueeze(0), keys, values, self.scale)
            out[rows] = attended.squeeze(0).transpose(0, 1)
        return self.o_proj(out.view(q.shape[0], self.num_heads * mla.v_head_dim))

    def _expanded_attention(self, queries: torch.Tensor, latents: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """Decode attention as HF computes it: every context latent expanded into this rank's per-head
        keys and values. queries [batch, heads, qk_head_dim], latents [batch, context, latent_dim],
        padding [batch, context] (True: not a context token) → [batch, heads, v_head_dim]."""
        keys, values = self._expand(latents)  # [batch, heads, context, dim]
        scores = torch.matmul(queries.unsqueeze(2), keys.transpose(-1, -2)) * self.scale
        scores.masked_fill_(padding[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
        return torch.matmul(probs, values).squeeze(2)

    def _absorbed_attention(self, queries: torch.Tensor, latents: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """Decode attention over the latents themselves (DeepSeek's weight absorption): a head's key
        is `W_UK · c` and its value `W_UV · c` for the token's latent c, so q · k = (W_UKᵀ q) · c and
        Σ p v = W_UV (Σ p c): the query is moved into the latent space once per row and the attended
        latent out of it once, instead of expanding every context token into per-head keys and values.
        queries [batch, heads, qk_head_dim], latents [batch, context, latent_dim] → [batch, heads, v_head_dim].
        The same sums in another order: fp32 logits move by rounding only (tests/engine/test_mla_absorbed.py)."""
        mla = self.mla
        w_uk, w_uv = self._absorbed_weights(queries)  # [heads, nope, rank], [heads, v, rank]
        q_nope, q_rot = queries.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        q_latent = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_rot], dim=-1)
        scores = torch.matmul(q_latent, latents.transpose(-1, -2)) * self.scale  # [batch, heads, context]
        scores.masked_fill_(padding[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
        attended = torch.matmul(probs, latents[..., : mla.kv_lora_rank])  # [batch, heads, rank]
        return torch.einsum("bhr,hvr->bhv", attended, w_uv)

    def _absorbed_weights(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b's weight for this rank's heads, split into W_UK [heads, nope, rank] and W_UV [heads, v,
        rank]: read back by applying the layer to the identity, so any weight format (int8 included)
        gives the values it multiplies by (a dense copy in the model dtype, kept after the first call)."""
        if self._absorbed is None:
            mla, proj = self.mla, self.kv_b_proj
            eye = torch.eye(mla.kv_lora_rank, dtype=like.dtype, device=like.device)
            weight = proj(eye).t().reshape(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
            w_uk, w_uv = weight.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
            self._absorbed = (w_uk.contiguous(), w_uv.contiguous())
        return self._absorbed

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


def set_absorbed_decode(model: nn.Module, enabled: bool) -> int:
    """Switches every MLA layer of `model` to absorbed (or expanded) decode attention; returns how many
    layers it set (0 for a model without MLA)."""
    layers = [module for module in model.modules() if isinstance(module, MLAttention)]
    for layer in layers:
        layer.absorbed_decode = enabled
    return len(layers)
