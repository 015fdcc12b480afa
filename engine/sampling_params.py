"""Per-request sampling parameters, validated once when constructed.

Defaults follow the ecosystem (vLLM / OpenAI): `temperature == 0` means greedy; `top_k=None`,
`top_p=1.0` and `min_p=0.0` disable those filters; penalties at their neutral values disable them.
`n` is for whoever fans a prompt out (the offline `LLM`, the OpenAI front): one engine sequence
always generates one completion. `logit_bias` (token id -> a bias in [-100, 100] added to its logit, as
OpenAI's field of that name) is given as a mapping or (id, bias) pairs and kept as sorted pairs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutputSpec

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_N = 64
MAX_LOGIT_BIAS = 1024  # biased tokens per request: enough to ban or force a word list, bounded per step
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1  # sequences per prompt; the offline API and the OpenAI front run n requests (seeds seed + i)
    skip_special_tokens: bool = True  # in the output text
    include_stop_str_in_output: bool = False  # output text ends after the stop string instead of before it
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias), ids ascending
    # Logprob of every prompt token after the first (and this many top alternatives), as vLLM's field of
    # that name: the prompt is computed in full (no prefix-cache hits) to produce them.
    prompt_logprobs: int | None = None
    # The output must match this JSON schema / regex / choice / grammar (engine/structured/): every
    # step's logits are masked to the tokens it allows, and the sequence ends when it is complete.
    structured_output: StructuredOutputSpec | None = None

    def __post_init__(self):
        # Lists are accepted for convenience and frozen into tuples so params stay hashable.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        object.__setattr__(self, "logit_bias", _as_bias_pairs(self.logit_bias))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias change the logits before sampling (greedy picks included)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    def for_choice(self, index: int) -> SamplingParams:
        """The params of completion `index` of n: one sequence, seed + index when seeded (so the
        choices differ, and each is reproducible)."""
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return replace(self, n=1, seed=seed)

    def _validate(self) -> None:
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must be an integer in [0, max_tokens]",
        )
        _check(_finite(self.temperature) and self.temperature >= 0.0, "temperature", "must be finite and >= 0")
        _check(
            self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1),
            "top_k",
            "must be None (disabled) or an integer >= 1",
        )
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            "must be finite and > 0",
        )
        _check(
            _finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        _check(
            _finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
            "seed",
            f"must be None or an integer in [0, {MAX_SEED}]",
        )
        _check(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids must be >= 0")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"must be None or an integer in [0, {MAX_LOGPROBS}]",
            )
        _check(
            self.structured_output is None or isinstance(self.structured_output, StructuredOutputSpec),
            "structured_output",
            "must be None or a StructuredOutputSpec",
        )
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in self.logit_bias:
            _check(token >= 0, "logit_bias", f"token id {token} must be >= 0")
            _check(
                _finite(bias) and abs(bias) <= MAX_ABS_LOGIT_BIAS,
                "logit_bias",
                f"the bias of token {token} must be a number in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]",
            )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    return _is_number(value) and math.isfinite(value)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


def _as_tuple(values, field_name: str, item_type: type) -> tuple:
    if isinstance(values, (str, bytes)) or values is None:
        values = () if values is None else (values,)
    items = tuple(values)
    if not all(isinstance(v, item_type) and not isinstance(v, bool) for v in items):
        raise InvalidRequestError(field_name, f"every item must be a {item_type.__name__}")
    return items


def _as_bias_pairs(values) -> tuple[tuple[int, float], ...]:
    """A mapping or (id, bias) pairs as (id, bias) pairs sorted by id; types checked here, ranges in
    `_validate`."""
    items = list(values.items() if isinstance(values, Mapping) else values or ())
    pairs = [tuple(p) for p in items if isinstance(p, (tuple, list)) and len(p) == 2]
    if len(pairs) != len(items) or not all(_is_int(t) and _is_number(b) for t, b in pairs):
        raise InvalidRequestError("logit_bias", "must map integer token ids to numbers")
    if len({token for token, _ in pairs}) != len(pairs):
        raise InvalidRequestError("logit_bias", "names a token id twice")
    return tuple(sorted((token, float(bias)) for token, bias in pairs))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
