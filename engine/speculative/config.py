"""`speculative_config`, in vLLM's shape, validated once; every error names its key.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    {"model": "DIR", "num_speculative_tokens": 4}              # method "draft_model" is implied
    {"model": "DIR", "quantization": "int8"}                   # the draft's weights quantized at load

`quantization` (draft_model only; default: the target's) is the draft's weight quantization, vLLM's key.
The target's own checkpoint as the draft with `quantization: int8` is self-speculation: it agrees with
the target on nearly every greedy token and reads a quarter of its weight bytes per step on CPU.

`adaptive` (default true) lets the engine switch speculation off per step when its measured cost per
output token is higher than plain decoding's (engine/speculative/adaptive.py); false speculates on
every step (tests, and seeded sampled requests that must replay identically, see the package doc).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.layers.quantization import QUANTIZATIONS

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(ValueError):
    """A speculative_config value is invalid; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # most draft tokens verified per sequence per step
    prompt_lookup_min: int = 1  # ngram: shortest suffix n-gram looked up in the sequence's own tokens
    prompt_lookup_max: int = 4  # ngram: longest; the longest one that matches wins
    model: str | None = None  # draft_model: checkpoint directory (same tokenizer and vocabulary)
    quantization: str | None = None  # draft_model: the draft's weight quantization; None = the target's
    adaptive: bool = True

    def __post_init__(self):
        _check(self.method in METHODS, "method", f"must be one of {list(METHODS)}, got {self.method!r}")
        _check(
            _is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            "num_speculative_tokens",
            f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]",
        )
        _check(
            _is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
            "prompt_lookup_min",
            "must be an integer >= 1",
        )
        _check(
            _is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
            "prompt_lookup_max",
            "must be an integer >= prompt_lookup_min",
        )
        _check(isinstance(self.adaptive, bool), "adaptive", "must be true or false")
        if self.method == "draft_model":
            _check(
                isinstance(self.model, str) and bool(self.model),
                "model",
                "method draft_model needs the draft checkpoint's directory",
            )
            _check(
                self.quantization is None or self.quantization in QUANTIZATIONS,
                "quantization",
                f"must be one of {list(QUANTIZATIONS)}, got {self.quantization!r}",
            )
        else:
            _check(self.model is None, "model", "only method draft_model takes a model")
            _check(self.quantization is None, "quantization", "only method draft_model takes a quantization")

    @classmethod
    def from_dict(cls, raw: Any) -> SpeculativeConfig:
        """From plain data (the LLM keyword, YAML, Helm values); unknown keys fail by name."""
        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise SpeculativeConfigError(f"speculative_config: must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        values = dict(raw)
        values.setdefault("method", "draft_model" if values.get("model") is not None else "ngram")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise SpeculativeConfigError(f"speculative_config.{key}: {message}")
