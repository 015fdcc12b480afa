"""Reading a Hugging Face checkpoint directory: `config.json` → `ModelConfig`, safetensors → weights.

Supported architectures are a registry (`ARCHITECTURES`); anything else fails naming what is known.
Single-file and sharded (`model.safetensors.index.json`) checkpoints load the same way: every tensor is
routed to the parameter that owns it, whose `weight_loader` keeps this rank's tensor-parallel slice.
Mixture-of-experts checkpoints store one tensor per expert and projection; each is routed to its slot
of the layer's fused expert tensors (engine/layers/fused_moe.py `expert_target`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.config import EngineConfig, MLAConfig, ModelConfig, MoEConfig, RopeConfig, resolve_dtype
from engine.errors import UnsupportedModelError
from engine.layers.fused_moe import expert_target
from engine.layers.quantization import weight_quantization
from engine.models.decoder import PACKED_WEIGHTS, DecoderForCausalLM
from engine.parallel import SINGLE_RANK, TensorParallelGroup
from engine.quantization import checkpoint_format
from engine.quantization.assembly import WeightAssembler


def _num_experts(raw: dict) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if raw.get(key):
            return int(raw[key])
    raise UnsupportedModelError("MoE config has no num_experts / num_local_experts / n_routed_experts")


def _mixtral_moe(raw: dict) -> MoEConfig:
    return MoEConfig(_num_experts(raw), raw["num_experts_per_tok"], raw["intermediate_size"], "softmax", True)


def _qwen_moe(raw: dict) -> MoEConfig:
    # HF: a layer is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid.
    step = raw.get("decoder_sparse_step") or 1
    only = set(raw.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(raw["num_hidden_layers"]) if i in only or (i + 1) % step)
    shared = raw.get("shared_expert_intermediate_size") or 0
    return MoEConfig(
        _num_experts(raw),
        raw["num_experts_per_tok"],
        raw["moe_intermediate_size"],
        "softmax",
        bool(raw.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_expert_gate=bool(shared),
        dense_layers=dense,
    )


_DEEPSEEK_V2_ROUTING = {"greedy": "softmax", "group_limited_greedy": "softmax_group_limited"}


def _deepseek_moe(raw: dict, routing: str, norm_topk_prob: bool) -> MoEConfig:
    return MoEConfig(
        _num_experts(raw),
        raw["num_experts_per_tok"],
        raw["moe_intermediate_size"],
        routing,
        norm_topk_prob,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_groups=raw.get("n_group") or 1,
        topk_groups=raw.get("topk_group") or 1,
        shared_intermediate_size=raw["moe_intermediate_size"] * (raw.get("n_shared_experts") or 0),
        dense_layers=tuple(range(raw.get("first_k_dense_replace") or 0)),
    )


def _deepseek_v2_moe(raw: dict) -> MoEConfig:
    method = raw.get("topk_method", "greedy")
    if method not in _DEEPSEEK_V2_ROUTING:
        raise UnsupportedModelError(f"DeepseekV2: topk_method {method!r}; supported: {sorted(_DEEPSEEK_V2_ROUTING)}")
    return _deepseek_moe(raw, _DEEPSEEK_V2_ROUTING[method], False)  # HF's V2 never renormalizes


def _deepseek_v3_moe(raw: dict) -> MoEConfig:
    return _deepseek_moe(raw, "sigmoid_grouped", bool(raw.get("norm_topk_prob", True)))


def _mla(raw: dict) -> MLAConfig:
    return MLAConfig(
        kv_lora_rank=raw["kv_lora_rank"],
        q_lora_rank=raw.get("q_lora_rank"),
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
        # V2 rotates interleaved pairs (as complex numbers); V3 by config (its weights: interleaved).
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )


# Sliding-window attention, per layer, as each family's transformers modeling code decides it (HF's
# masks: the query at p sees keys (p - sliding_window, p]). A window of None or 0 slides nothing.
_LAYER_KINDS = {"full_attention": False, "sliding_attention": True}


def _no_windows(raw: dict) -> tuple[int | None, ...]:
    return ()


def _window_size(raw: dict, enabled: bool) -> int | None:
    window = raw.get("sliding_window")
    if not enabled or not window:
        return None
    if not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"sliding_window: must be a positive integer, got {window!r}")
    return window


def _layer_windows(raw: dict, window: int | None, slides: Callable[[int], bool]) -> tuple[int | None, ...]:
    """`window` for the layers i where `slides(i)`; empty when no layer slides."""
    if window is None:
        return ()
    windows = tuple(window if slides(i) else None for i in range(raw["num_hidden_layers"]))
    return windows if any(w is not None for w in windows) else ()


def _by_layer_types(raw: dict, default: Callable[[int], bool]) -> Callable[[int], bool]:
    """The config's `layer_types` (transformers 5.x) where it has them, else the family's `default`."""
    kinds = raw.get("layer_types")
    if kinds is None:
        return default
    if len(kinds) != raw["num_hidden_layers"] or any(kind not in _LAYER_KINDS for kind in kinds):
        raise UnsupportedModelError(
            f"layer_types: must list one of {sorted(_LAYER_KINDS)} for each of the {raw['num_hidden_layers']} layers, "
            f"got {kinds!r}"
        )
    return lambda i: _LAYER_KINDS[kinds[i]]


def _every_layer_windows(raw: dict) -> tuple[int | None, ...]:
    # Mistral, Mixtral: every layer slides when sliding_window is set (their modeling ignores layer_types).
    return _layer_windows(raw, _window_size(raw, True), lambda i: True)


def _qwen3_moe_windows(raw: dict) -> tuple[int | None, ...]:
    # Qwen3-MoE: every layer, with use_sliding_window (max_window_layers and layer_types are not read).
    return _layer_windows(raw, _window_size(raw, bool(raw.get("use_sliding_window"))), lambda i: True)


def _qwen_windows(raw: dict) -> tuple[int | None, ...]:
    # Qwen2, Qwen3: with use_sliding_window, the layers from max_window_layers on (or as layer_types say).
    window = _window_size(raw, bool(raw.get("use_sliding_window")))
    first = raw.get("max_window_layers", 28)
    return _layer_windows(raw, window, _by_layer_types(raw, lambda i: i >= first))


def _qwen2_moe_windows(raw: dict) -> tuple[int | None, ...]:
    # Qwen2-MoE: with use_sliding_window, the even layers below max_window_layers (or as layer_types say).
    window = _window_size(raw, bool(raw.get("use_sliding_window")))
    below = raw.get("max_window_layers", 28)
    return _layer_windows(raw, window, _by_layer_types(raw, lambda i: i % 2 == 0 and i < below))


@dataclass(frozen=True)
class ArchitectureTraits:
    qkv_bias: bool | None  # None: read `attention_bias` from the config
    qk_norm: bool
    moe: Callable[[dict], MoEConfig] | None = None  # reads the MoE block's config; None: dense
    mla: bool = False  # multi-head latent attention (engine/models/mla.py)
    # Checkpoint name fragments renamed at load to the engine's module names (HF's differ by family).
    renames: tuple[tuple[str, str], ...] = ()
    windows: Callable[[dict], tuple[int | None, ...]] = _no_windows  # each layer's sliding window


_DEEPSEEK_RENAMES = ((".mlp.shared_experts.", ".mlp.shared_expert."),)
ARCHITECTURES = {
    "LlamaForCausalLM": ArchitectureTraits(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": ArchitectureTraits(qkv_bias=None, qk_norm=False, windows=_every_layer_windows),
    "Qwen2ForCausalLM": ArchitectureTraits(qkv_bias=True, qk_norm=False, windows=_qwen_windows),
    "Qwen3ForCausalLM": ArchitectureTraits(qkv_bias=None, qk_norm=True, windows=_qwen_windows),
    "MixtralForCausalLM": ArchitectureTraits(
        qkv_bias=None,
        qk_norm=False,
        moe=_mixtral_moe,
        renames=((".block_sparse_moe.", ".mlp."),),
        windows=_every_layer_windows,
    ),
    "Qwen2MoeForCausalLM": ArchitectureTraits(qkv_bias=True, qk_norm=False, moe=_qwen_moe, windows=_qwen2_moe_windows),
    "Qwen3MoeForCausalLM": ArchitectureTraits(qkv_bias=None, qk_norm=True, moe=_qwen_moe, windows=_qwen3_moe_windows),
    "DeepseekV2ForCausalLM": ArchitectureTraits(
        qkv_bias=None, qk_norm=False, moe=_deepseek_v2_moe, mla=True, renames=_DEEPSEEK_RENAMES
    ),
    "DeepseekV3ForCausalLM": ArchitectureTraits(
        qkv_bias=None, qk_norm=False, moe=_deepseek_v3_moe, mla=True, renames=_DEEPSEEK_RENAMES
    ),
}
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
IDENTITY_SAMPLE_BYTES = 1 << 20  # weight bytes per shard folded into the model identity


def load_model_config(model_dir: str | Path, dtype: str = "auto") -> ModelConfig:
    model_dir = Path(model_dir)
    config_path = _require_file(model_dir, "config.json")
    raw = json.loads(config_path.read_text())
    arch = _architecture(raw)
    traits = ARCHITECTURES[arch]
    if raw.get("mlp_bias") or (arch == "Qwen2ForCausalLM" and raw.get("attention_bias")):
        raise UnsupportedModelError(f"{arch}: bias on MLP / output projections is not supported")
    if raw.get("attention_bias") and traits.qkv_bias is None:
        raise UnsupportedModelError(f"{arch}: attention_bias=true is not supported")
    num_heads = raw["num_attention_heads"]
    mla = _mla(raw) if traits.mla else None
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        # MLA's cache: one latent "head" per token (engine/models/mla.py).
        num_kv_heads=1 if mla is not None else raw.get("num_key_value_heads") or num_heads,
        head_dim=mla.latent_dim if mla is not None else raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=_max_positions(raw),
        rope=_rope_config(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(traits.qkv_bias),
        qk_norm=traits.qk_norm,
        dtype=resolve_dtype(dtype, raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        eos_token_ids=_eos_ids(raw, model_dir),
        bos_token_id=raw.get("bos_token_id"),
        identity=_identity(arch, config_path, model_dir) + _quantization_label(raw),
        moe=traits.moe(raw) if traits.moe is not None else None,
        mla=mla,
        sliding_windows=traits.windows(raw),
    )


def load_engine_model_config(engine_cfg: EngineConfig) -> ModelConfig:
    """The checkpoint's config as this engine runs it. Its identity (which seeds block hashes and
    namespaces prefix indexes) also names the KV cache format, so KV cached in one format is never
    matched, pulled or handed off to an engine storing another."""
    model = load_model_config(engine_cfg.model_dir, engine_cfg.dtype)
    return replace(model, identity=f"{model.identity}/kv-{engine_cfg.kv_format(model).name}")


def load_model(
    engine_cfg: EngineConfig,
    model_cfg: ModelConfig,
    max_positions: int,
    tp: TensorParallelGroup = SINGLE_RANK,
    progress: bool = False,
) -> DecoderForCausalLM:
    fmt = checkpoint_format(json.loads((Path(engine_cfg.model_dir) / "config.json").read_text()))
    quantization = weight_quantization(
        engine_cfg.quantization,
        engine_cfg.quantization_group_size,
        fmt.method if fmt else None,
        torch.device(engine_cfg.device).type,
    )
    with torch.device("cpu"):
        model = DecoderForCausalLM(
            model_cfg, max_positions, tp, quantization, engine_cfg.quantize_lm_head, engine_cfg.expert_parallel
        )
    renames = ARCHITECTURES[model_cfg.architecture].renames
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = _weight_files(Path(engine_cfg.model_dir))
    names = [name for path in files for name in _tensor_names(path)]
    assembler = WeightAssembler(fmt, names)  # pre-quantized layers arrive as their dequantized weight
    total = len(names)
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress) as bar:
        for path in files:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle has keys() but no __iter__
                    bar.update()
                    if _skipped(name, model_cfg):
                        continue
                    for target, tensor in assembler.feed(name, handle.get_tensor(name)):
                        loaded.add(_load_tensor(params, _renamed(target, renames), tensor))
    if model_cfg.tie_word_embeddings and not model.lm_head_shares_embedding:  # a quantized copy of the embedding
        head: Any = model.lm_head.weight  # a Parameter its LinearMethod gave a weight_loader (undeclared)
        head.weight_loader(head, model.model.embed_tokens.weight.to(getattr(head, "load_dtype", head.dtype)))
    derived = {name for name, param in params.items() if hasattr(param, "filled_by")}
    missing = sorted(set(params) - loaded - _tied_names(model_cfg) - derived)
    if missing:
        raise UnsupportedModelError(f"checkpoint {engine_cfg.model_dir} lacks tensors: {missing[:5]}")
    return model.eval()


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        name = name.replace(old, new)
    return name


def _load_tensor(params: dict, name: str, tensor: torch.Tensor) -> str:
    expert = expert_target(name)
    if expert is not None:
        target, expert_shard = expert
        param = _param(params, target, name)
        param.weight_loader(param, tensor.to(_load_dtype(param)), expert_shard)
        return target
    for fragment, (fused, shard_id) in PACKED_WEIGHTS.items():
        target = name.replace(f".{fragment}.", f".{fused}.")
        # A fragment only packs where the model has the fused parameter (MLA's q_proj stays itself).
        if f".{fragment}." in name and target in params:
            param = params[target]
            param.weight_loader(param, tensor.to(_load_dtype(param)), shard_id)
            return target
    param = _param(params, name, name)
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        if param.shape != tensor.shape:
            raise UnsupportedModelError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor.to(param.dtype))
    else:
        loader(param, tensor.to(_load_dtype(param)))
    return name


def _load_dtype(param) -> torch.dtype:
    """What a loader receives: the parameter's dtype, or full precision where it quantizes."""
    return getattr(param, "load_dtype", param.dtype)


def _skipped(name: str, cfg: ModelConfig) -> bool:
    # Old checkpoints carry RoPE buffers; tied checkpoints may carry a copy of the embedding; DeepSeek-V3
    # checkpoints carry their multi-token-prediction layers past num_hidden_layers (unused here).
    layer = _LAYER_INDEX.match(name)
    return (
        "rotary_emb.inv_freq" in name
        or (name == "lm_head.weight" and cfg.tie_word_embeddings)
        or (layer is not None and int(layer[1]) >= cfg.num_layers)
    )


def _param(params: dict, target: str, source: str):
    if target not in params:
        raise UnsupportedModelError(f"checkpoint tensor {source!r} has no place in the model")
    return params[target]


def _tied_names(cfg: ModelConfig) -> set[str]:
    return {"lm_head.weight"} if cfg.tie_word_embeddings else set()


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures") or []
    known = sorted(ARCHITECTURES)
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise UnsupportedModelError(f"unsupported architecture {archs or raw.get('model_type')!r}; supported: {known}")


def _rope_config(raw: dict) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    fields = {
        k: params[k]
        for k in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        )
        if params.get(k) is not None
    }
    return RopeConfig(theta=float(theta), rope_type=rope_type, **fields)


def _max_positions(raw: dict) -> int:
    # Sliding-window layers attend within their window at any position: the limit is the positions'.
    return raw.get("max_position_embeddings", 2048)


def _eos_ids(raw: dict, model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    gen_path = model_dir / "generation_config.json"
    sources = [raw.get("eos_token_id")]
    if gen_path.exists():
        sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [_require_file(model_dir, shard) for shard in shards]
    return [_require_file(model_dir, "model.safetensors")]


def _tensor_names(path: Path) -> list[str]:
    with safe_open(path, framework="pt") as handle:
        return list(handle.keys())


def _identity(arch: str, config_path: Path, model_dir: Path) -> str:
    # Config plus a sample of every weight file: distinguishes checkpoints of the same shape cheaply.
    digest = hashlib.blake2b(config_path.read_bytes(), digest_size=16)
    try:
        files = _weight_files(model_dir)
    except UnsupportedModelError:
        files = []
    for path in files:
        with open(path, "rb") as handle:
            digest.update(handle.read(IDENTITY_SAMPLE_BYTES))
    return f"{arch}/{digest.hexdigest()}"


def _quantization_label(raw: dict) -> str:
    fmt = checkpoint_format(raw)  # fails here, at config time, naming an unsupported quant_method
    return "" if fmt is None else f"/{fmt.label}"


def _require_file(model_dir: Path, name: str) -> Path:
    path = model_dir / name
    if not path.is_file():
        raise UnsupportedModelError(f"checkpoint directory {model_dir} has no {name}")
    return path
