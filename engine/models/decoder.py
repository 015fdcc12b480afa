"""The decoder-only transformer shared by the supported families (Llama, Qwen2, Mistral, Qwen3).

They differ only in switches taken from the checkpoint config: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings, RoPE scaling. Tokens of a step are flattened to `[num_tokens, hidden]`
(no padding); attention reads/writes the paged cache through `engine.attention`.

Module names mirror HF's so checkpoint tensors map by name; `PACKED_WEIGHTS` says which HF tensors
were fused into which of our parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kv_storage import KVCacheStorage, LayerKV
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.quantization import linear_method
from engine.layers.rotary import RotaryEmbedding
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
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, quantization: str):
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

    def forward(self, rope, hidden, cache: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        """`rope`: this step's (cos, sin) rows from `RotaryEmbedding.lookup`."""
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (cfg.qk_norm)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.rotate(q, *rope), RotaryEmbedding.rotate(k, *rope)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, quantization: str):
        super().__init__()
        dtype = cfg.torch_dtype
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], False, dtype, tp, linear_method(quantization)
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, dtype, tp, linear_method(quantization))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel instead of two (engine/kernels/triton_fused.py)
            from engine.kernels.triton_fused import silu_mul

            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallelGroup, quantization: str):
        super().__init__()
        self.self_attn = Attention(cfg, tp, quantization)
        self.mlp = MLP(cfg, tp, quantization)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)

    def forward(self, rope, hidden, cache: LayerKV, meta) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallelGroup, quantization: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.torch_dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, quantization) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.torch_dtype)


class DecoderForCausalLM(nn.Module):
    """`forward` returns final hidden states for every token; `compute_logits` projects chosen rows.

    `quantization` (engine/layers/quantization.py) applies to every linear layer of the decoder and,
    with `quantize_lm_head`, to the LM head (a tied head then gets its own quantized copy of the
    embedding, which stays in the model dtype for lookups)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: TensorParallelGroup = SINGLE_RANK,
        quantization: str = "none",
        quantize_lm_head: bool = False,
    ):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, tp, quantization)
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
        for index, layer in enumerate(self.model.layers):
            hidden = layer(rope, hidden, kv_cache.layer(index), meta)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).to(torch.float32)
