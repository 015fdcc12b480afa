"""The decoder-only transformer shared by the supported families (Llama, Qwen2, Mistral, Qwen3, and the
mixture-of-experts / latent-attention ones: Mixtral, Qwen2/Qwen3-MoE, DeepSeek-V2/V3).

They differ only in switches taken from the checkpoint config: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings, RoPE scaling, each layer's sliding window (Mistral, Qwen); the attention of a
layer is grouped-query (`Attention`) or latent (engine/models/mla.py, when the config has `mla`), its
feed-forward block dense or a mixture of experts (engine/models/moe.py, when the config has `moe`).
Tokens of a step are flattened to `[num_tokens, hidden]` (no padding); attention reads/writes the paged
cache through `engine.attention`.

Module names mirror HF's so checkpoint tensors map by name; `PACKED_WEIGHTS` says which HF tensors
were fused into which of our parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv_storage import KVCacheStorage
from engine.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.quantization import QuantizationSpec, linear_method
from engine.layers.rotary import RotaryEmbedding
from engine.models.mla import MLAttention
from engine.models.moe import feed_forward
from engine.parallel import SINGLE_RANK, TensorParallelGroup

# HF tensor name fragment → (our fused parameter fragment, shard id)
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, quantization: QuantizationSpec):
        super().__init__()
        dtype = cfg.torch_dtype
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.qkv_bias,
            dtype,
            tp,
            linear_method(quantization),
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, dtype, tp, linear_method(quantization)
        )
        self.num_heads = self.qkv_proj.num_heads_local
        self.num_kv_heads = self.qkv_proj.num_kv_heads_local
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.sliding_windows = cfg.sliding_windows  # per layer; forward reads its layer's by index

    def forward(self, rope, hidden, kv_cache: KVCacheStorage, index: int, meta: AttentionMetadata) -> torch.Tensor:
        """`rope`: this step's (cos, sin) rows from `RotaryEmbedding.lookup`; reads layer `index` of the cache."""
        cache = kv_cache.layer(index)
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (cfg.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.rotate(q, *rope), RotaryEmbedding.rotate(k, *rope)
        window = self.sliding_windows[index] if self.sliding_windows else None
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale, window))


# A layer's attention, by whether the config has MLA.
ATTENTIONS: dict[bool, type[Attention | MLAttention]] = {False: Attention, True: MLAttention}


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        tp: TensorParallelGroup,
        quantization: QuantizationSpec,
        expert_parallel: bool,
    ):
        super().__init__()
        self.index = index
        self.self_attn = ATTENTIONS[cfg.mla is not None](cfg, tp, quantization)
        self.mlp = feed_forward(cfg, index, tp, quantization, expert_parallel)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)

    def forward(self, rope, hidden, kv_cache: KVCacheStorage, meta) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, self.index, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: TensorParallelGroup,
        quantization: QuantizationSpec,
        expert_parallel: bool = True,
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.torch_dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rope_dim, max_positions)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, index, tp, quantization, expert_parallel) for index in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)


class DecoderForCausalLM(nn.Module):
    """`forward` returns final hidden states for every token; `compute_logits` projects chosen rows.

    `quantization` (engine/layers/quantization.py) applies to every linear layer of the decoder and,
    with `quantize_lm_head`, to the LM head (a tied head then gets its own quantized copy of the
    embedding, which stays in the model dtype for lookups). `expert_parallel`: under TP, MoE layers
    split whole experts across the ranks instead of every expert's features (engine/layers/fused_moe.py)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: TensorParallelGroup = SINGLE_RANK,
        quantization: QuantizationSpec = "none",
        quantize_lm_head: bool = False,
        expert_parallel: bool = True,
    ):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, tp, quantization, expert_parallel)
        self.lm_head = ReplicatedLinear(
            cfg.hidden_size,
            cfg.vocab_size,
            cfg.torch_dtype,
            linear_method(quantization if quantize_lm_head else "none"),
        )
        self.lm_head_shares_embedding = cfg.tie_word_embeddings and not quantize_lm_head
        if self.lm_head_shares_embedding:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCacheStorage, meta: AttentionMetadata
    ) -> torch.Tensor:
        """kv_cache: this rank's paged cache (its KV heads)."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary.lookup(positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(rope, hidden, kv_cache, meta)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).to(torch.float32)
