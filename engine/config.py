"""Typed, frozen configuration: what the checkpoint says (`ModelConfig`) and how to run it (`EngineConfig`).

The engine keys are declared once, here, in two groups the cluster's config reuses rather than repeats:
`ModelFormat` (cluster-wide) and `EngineLimits` (per pool). Each group validates its own keys when built,
and errors name the key (`ConfigError`); cross-field rules live here, not in callers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.errors import UnsupportedModelError
from engine.kv_quant import KV_CACHE_DTYPES, KVFormat, kv_format
from engine.layers.quantization import QUANTIZATIONS
from engine.speculative.config import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROLES = ("colocated", "prefill", "decode")
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn only (HF's names): the ramp between interpolated and extrapolated frequencies, and the
    # attention factor scaling cos/sin (None: derived from factor, mscale and mscale_all_dim).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward block, as the checkpoint's config describes it
    (engine/models/moe.py computes the routing its `routing` names, exactly as that HF family does)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    routing: str  # a name in engine/models/moe.py ROUTERS
    norm_topk_prob: bool  # renormalize the chosen experts' weights to sum to 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by it (DeepSeek)
    num_groups: int = 1  # grouped routing (DeepSeek): experts in n_group groups, topk_group of them kept
    topk_groups: int = 1
    shared_intermediate_size: int = 0  # the always-on shared expert's width; 0: none
    shared_expert_gate: bool = False  # the shared expert's output is scaled by sigmoid(x·g) (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (intermediate_size wide) instead


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one latent vector per token and
    layer, `kv_lora_rank + qk_rope_head_dim` wide, shared by every head (engine/models/mla.py)."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q is projected directly from the hidden state
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary dimensions are laid out in interleaved pairs (DeepSeek's weights)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """What the checkpoint's config.json says, in the engine's own names. `num_kv_heads` and
    `head_dim` describe the KV cache: with MLA one latent "head" of `mla.latent_dim`, stored once
    (`kv_planes` 1) instead of as K and V."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    identity: str = ""  # stable id of the checkpoint (arch + digest of config.json); seeds block hashes
    moe: MoEConfig | None = None  # None: every layer's feed-forward block is dense
    mla: MLAConfig | None = None  # None: grouped-query attention with per-head K/V
    # Sliding-window attention, per layer: the query at position p sees keys (p - window, p], the
    # window counting p itself (HF's masks); None for a layer attending to its whole context. Empty:
    # no layer slides.
    sliding_windows: tuple[int | None, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_planes(self) -> int:
        """Tensors the KV cache stores per token, layer and head: K and V (2), or MLA's latent (1)."""
        return 1 if self.mla is not None else 2

    def sliding_window(self, layer: int) -> int | None:
        """Layer `layer`'s window in tokens, or None where it attends to its whole context."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the key it names (`block_size: ...`).
    Every config class of the project raises it, and a loader of nested sections prefixes the section."""


def check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclass(frozen=True)
class ModelFormat:
    """How a model and its KV cache are stored and hashed: the keys every engine of a cluster shares
    (a cluster declares them once, cluster-wide; blocks move between its workers exactly as stored)."""

    dtype: str = "auto"  # weights and activations: auto (the checkpoint's), float32, bfloat16 or float16
    block_size: int = 16  # tokens per KV block (the unit of the prefix cache, hand-offs and the prefix index)
    kv_cache_dtype: str = "auto"  # how KV blocks are stored (engine/kv_quant.py): auto (the model dtype), int8, fp8
    quantization: str = "none"  # weights (engine/layers/quantization.py): none, int8 (per channel) or int4 (group-wise)
    # Input features per weight scale group when quantizing at load, a multiple of 32: int8 then keeps one
    # scale per group instead of per output channel; int4 rounds in groups of it. None: int8 per channel,
    # int4 groups of 128. A pre-quantized checkpoint keeps its own groups.
    quantization_group_size: int | None = None
    enable_prefix_caching: bool = True  # reuse cached prefix blocks (a cluster caches on its prefill workers)
    seed: int = 0  # seeds sampling where a request gives no seed of its own

    def __post_init__(self):
        check(self.dtype == "auto" or self.dtype in DTYPES, "dtype", f"must be auto or one of {sorted(DTYPES)}")
        check(self.block_size >= 1, "block_size", "must be >= 1")
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )
        check(
            self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}",
        )
        group_size = self.quantization_group_size
        check(
            group_size is None or (isinstance(group_size, int) and group_size > 0 and group_size % 32 == 0),
            "quantization_group_size",
            f"must be None or a positive multiple of 32, got {group_size!r}",
        )


@dataclass(frozen=True)
class EngineLimits:
    """One engine's limits: the keys a colocated engine and every worker of a cluster pool share."""

    # The KV cache's memory per engine (per rank under tensor parallelism); num_kv_blocks, when set, wins.
    kv_cache_memory_bytes: int = 2 * 1024**3
    num_kv_blocks: int | None = None  # a fixed KV pool in blocks; None: kv_cache_memory_bytes / bytes per block
    max_num_seqs: int = 256  # sequences one engine step may run
    max_num_batched_tokens: int = 2048  # tokens one engine step may compute
    prefill_chunk_tokens: int = 512  # most prompt tokens one sequence computes in one step

    def __post_init__(self):
        check(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be > 0")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be None or >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        check(self.prefill_chunk_tokens >= 1, "prefill_chunk_tokens", "must be >= 1")


@dataclass(frozen=True)
class EngineConfig(ModelFormat, EngineLimits):
    """How to run a model: the shared keys (`ModelFormat`, `EngineLimits`) plus what only one engine has.
    `None` fields are derived from the checkpoint."""

    model_dir: str = ""
    role: str = "colocated"  # colocated, prefill or decode
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    tp_size: int = 1
    # Under tensor parallelism, MoE layers split whole experts across the ranks (expert parallelism);
    # false: every rank holds a slice of every expert (engine/layers/fused_moe.py).
    expert_parallel: bool = True
    # MLA models: decode attends over the latent cache directly, the key and value up-projections folded
    # into the query and the output (engine/models/mla.py; faster: docs/performance.md); false: the
    # latents are expanded per head, as HF computes it.
    mla_absorbed_decode: bool = True
    quantize_lm_head: bool = False  # with `quantization`, the LM head too (its accuracy: docs/performance.md)
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": where weights, KV cache and steps live
    cuda_graphs: bool = True  # on CUDA, replay captured graphs for decode-only steps (engine/cuda_graphs.py)
    # Speculative decoding (engine/speculative): a SpeculativeConfig, or its plain-data form (vLLM's keys).
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self):
        ModelFormat.__post_init__(self)
        EngineLimits.__post_init__(self)
        check(self.role in ROLES, "role", f"must be one of {list(ROLES)}, got {self.role!r}")
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        check(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")
        check(self.tp_size >= 1, "tp_size", "must be >= 1")
        quantized = self.quantization != "none"
        check(not self.quantize_lm_head or quantized, "quantize_lm_head", "needs a weight quantization")
        check(
            self.quantization_group_size is None or quantized,
            "quantization_group_size",
            "needs a weight quantization (int8 or int4)",
        )
        check(
            _DEVICE_PATTERN.fullmatch(self.device) is not None,
            "device",
            f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}",
        )
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
            check(
                self.role != "prefill",
                "speculative_config",
                "the prefill role samples one token and hands off; speculation belongs to decode and colocated engines",
            )

    @property
    def decode_chunk_tokens(self) -> int:
        """Longest chunk a step lays out as decode rows: 1, or 1 + k when speculating (a verify chunk:
        the last token and up to k drafts, engine/model_runner.py)."""
        spec = self.speculative_config
        return 1 + spec.num_speculative_tokens if isinstance(spec, SpeculativeConfig) else 1

    def kv_format(self, model: ModelConfig) -> KVFormat:
        return kv_format(self.kv_cache_dtype, model.torch_dtype)

    def num_blocks_for(self, model: ModelConfig, draft: ModelConfig | None = None) -> int:
        """`draft`: a draft model's config; its KV cache has as many blocks as the target's (same block
        tables) and lives unsharded on rank 0, so it shares this budget."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        # The real bytes of the format (scales included): a quantized pool holds more blocks.
        bytes_per_token = self.kv_format(model).bytes_per_token(
            model.num_layers, model.num_kv_heads, model.head_dim, model.kv_planes
        )
        # MLA's latent is replicated on every rank, not split by head.
        block_bytes = bytes_per_token * self.block_size // (1 if model.mla is not None else self.tp_size)
        if draft is not None:
            block_bytes += self.block_size * self.kv_format(draft).bytes_per_token(
                draft.num_layers, draft.num_kv_heads, draft.head_dim, draft.kv_planes
            )
        by_memory = max(1, self.kv_cache_memory_bytes // block_bytes)
        # More than every sequence at full length (twice over, for the prefix cache) is never used.
        blocks_per_seq = -(-self.max_len_for(model) // self.block_size)
        return min(by_memory, 2 * self.max_num_seqs * blocks_per_seq)

    def max_len_for(self, model: ModelConfig) -> int:
        limit = model.max_position_embeddings
        if self.max_model_len is None:
            return limit
        check(
            self.max_model_len <= limit,
            "max_model_len",
            f"{self.max_model_len} exceeds the model's max_position_embeddings {limit}",
        )
        return self.max_model_len


def resolve_dtype(requested: str, checkpoint_dtype: str) -> str:
    if requested == "auto":
        if checkpoint_dtype not in DTYPES:
            raise UnsupportedModelError(f"checkpoint dtype {checkpoint_dtype!r} is not one of {sorted(DTYPES)}")
        return checkpoint_dtype
    return requested
