"""Tiny random HF checkpoints and an HF greedy reference for exact-token tests.

The engine must reproduce `transformers` greedy decoding token for token. These factories build
small checkpoints of every supported architecture whose weights are large enough that attention is
sharp (so position, mask and RoPE bugs change tokens) while the greedy top-1 margin stays hundreds of
times above fp32 reordering noise (so a token mismatch means a real bug, not a rounding tie).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from engine.demo_model import NUM_SPECIAL_TOKENS, SPECIAL_TOKEN_IDS, train_tokenizer
from engine.layers.int8_group_matmul import dequantize_groupwise, quantize_groupwise
from engine.layers.quantization import quantize_per_channel

ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3")

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
    "qwen3": Qwen3Config,
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Std of every random weight. With HF's default 0.02 a 64-wide model's attention logits have std
# ~0.03, i.e. attention is a plain average: changing rope_theta left 16 greedy tokens unchanged. At
# 0.25 attention logits have std ~4 and the same change flips tokens within a few steps, while the
# smallest top-1 margin seen on greedy paths stayed >250x the fp32-vs-fp64 logit error. Much larger
# (0.5) saturates attention and amplifies rounding, shrinking that ratio.
_WEIGHT_STD = 0.25
# RMSNorm gains are jittered around 1 so that a loader that skips (or swaps) a norm weight changes
# the output instead of silently matching HF's all-ones default.
_NORM_JITTER = 0.2
# Below the default tiny embedding table (128 KiB), so a sharded save always yields several files.
_SHARD_SIZE_BYTES = 64 * 1024
_TOKENIZER_MIN_VOCAB = 256 + NUM_SPECIAL_TOKENS


@dataclass(frozen=True)
class TinySpec:
    """Shape of one tiny checkpoint; every field maps to one HF config knob or save option."""

    arch: str = "llama"
    num_heads: int = 4
    num_kv_heads: int = 2  # = num_heads → MHA, 1 → MQA
    head_dim: int = 16
    hidden_size: int = 64
    num_layers: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    tie_word_embeddings: bool = False
    # Extra transformers-5 `rope_parameters` entries, e.g. {"rope_type": "linear", "factor": 2.0}.
    rope_scaling: dict | None = None
    dtype: str = "float32"
    max_position_embeddings: int = 512
    sharded: bool = False  # several safetensors shards + model.safetensors.index.json
    seed: int = 0
    # Std of the random weights. The default makes attention sharp for exactness tests; accuracy tests
    # of quantization use HF's default initializer range (0.02), whose softer attention is closer to
    # how trained models respond to small perturbations (see tests/engine/test_quantized_accuracy.py).
    weight_std: float = _WEIGHT_STD
    # False: no tokenizer is saved, so the vocabulary may be tiny (distribution tests over a few tokens).
    with_tokenizer: bool = True

    def __post_init__(self) -> None:
        if self.arch not in _CONFIG_CLASSES:
            raise ValueError(f"unknown arch {self.arch!r}; known: {sorted(_CONFIG_CLASSES)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(_DTYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.with_tokenizer and self.vocab_size < _TOKENIZER_MIN_VOCAB:
            # A byte-level tokenizer needs all 256 bytes plus the special tokens.
            raise ValueError(
                f"vocab_size={self.vocab_size} < {_TOKENIZER_MIN_VOCAB} (byte-level minimum)"
            )


def _hf_config(spec: TinySpec) -> PretrainedConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0, **(spec.rope_scaling or {})}
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters=rope,
        rms_norm_eps=1e-6,
        initializer_range=spec.weight_std,
        dtype=spec.dtype,
        **SPECIAL_TOKEN_IDS,
    )
    if spec.arch == "qwen2" and spec.head_dim * spec.num_heads == spec.hidden_size:
        # Real Qwen2 configs carry no head_dim (it is implied); mirror that so loaders derive it.
        del common["head_dim"]
    if spec.arch in ("mistral", "qwen2", "qwen3"):
        # No sliding window: the engine implements full causal attention only.
        common["sliding_window"] = None
    return _CONFIG_CLASSES[spec.arch](**common)


def _randomize_(model: PreTrainedModel, seed: int, std: float) -> None:
    """Overwrite every parameter from one seeded generator, independent of HF's init order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + _NORM_JITTER * noise.clamp(-2, 2) / 2)
            else:
                # Biases (qwen2 q/k/v) are random too, so dropping them is caught.
                param.copy_(std * noise)


@functools.lru_cache(maxsize=None)
def _tokenizer(vocab_size: int, model_max_length: int):
    # Training takes ~0.02 s but tests build dozens of checkpoints; train once per shape per process.
    return train_tokenizer(vocab_size, model_max_length)


def make_tiny_checkpoint(out_dir: Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a random `spec`-shaped checkpoint plus a byte-level BPE tokenizer into `out_dir`."""
    out_dir = Path(out_dir)
    # HF's constructor init draws from the global RNG; fork it so callers' RNG streams are untouched
    # (every value it draws is overwritten by _randomize_ anyway).
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(_hf_config(spec), dtype=torch.float32)
    _randomize_(model, spec.seed, spec.weight_std)
    model = model.to(_DTYPES[spec.dtype]).eval()
    model.generation_config = GenerationConfig(**SPECIAL_TOKEN_IDS)
    sharding = {"max_shard_size": _SHARD_SIZE_BYTES} if spec.sharded else {}
    model.save_pretrained(out_dir, safe_serialization=True, **sharding)
    if spec.with_tokenizer:
        tokenizer = _tokenizer(spec.vocab_size, spec.max_position_embeddings)
        tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    return out_dir


def dequantized_checkpoint(
    model_dir: Path, out_dir: Path, quantize_lm_head: bool, group_size: int | None = None
) -> Path:
    """The checkpoint with every linear weight the int8 engine quantizes (the decoder layers', and the LM
    head's with `quantize_lm_head`) replaced by its int8 value x scale (per output channel, or per
    group of `group_size` inputs): HF on it computes, in fp32, what that engine should."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert not model.config.tie_word_embeddings, "a tied head would dequantize the embedding too"
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (name.startswith("model.layers.") or quantize_lm_head):
                if group_size is None:
                    values, scale = quantize_per_channel(module.weight)
                    module.weight.copy_(values.float() * scale[:, None])
                else:
                    values, scales = quantize_groupwise(module.weight, group_size)
                    module.weight.copy_(dequantize_groupwise(values, scales))
    model.save_pretrained(out_dir)
    return out_dir


def hf_greedy_generate(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, batch_size: int | None = None,
    device: str = "cpu", dtype: str = "float32", **generate_options,
) -> list[list[int]]:
    """Reference continuations: HF greedy (fp32 on the CPU unless told), EOS ignored, left-padded
    batches; new tokens only.

    `batch_size=None` runs all prompts as one batch; `1` runs them one at a time. `generate_options`
    go to `generate` as they are (`sequence_bias`, `repetition_penalty`).
    """
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[dtype]).to(device).eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # Replacing the loaded generation config drops its eos_token_id, so no EOS stopping criterion
    # is built and every sequence runs exactly max_new_tokens (the engine's ignore_eos behaviour).
    model.generation_config = GenerationConfig(pad_token_id=pad_id)
    step = batch_size or max(len(prompts), 1)
    outputs: list[list[int]] = []
    for start in range(0, len(prompts), step):
        outputs.extend(_generate_batch(model, prompts[start : start + step], max_new_tokens, pad_id, generate_options))
    return outputs


def _generate_batch(
    model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, pad_id: int, options: dict
) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **options,
        )
    return [row[width:].tolist() for row in out]


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is log_softmax of HF's fp32 logits at position p (scoring token p + 1)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return logits.log_softmax(dim=-1)


def random_prompts(n: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`n` prompts of random length in [min_len, max_len], ids drawn past the special tokens.

    Special ids are excluded so a prompt never contains pad/eos, which would make its meaning
    depend on how a runner treats those ids.
    """
    rng = random.Random(seed)
    return [
        [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(n)
    ]
