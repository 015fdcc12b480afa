"""Per-request sampling parameters, validated once when constructed.

Defaults follow the ecosystem (vLLM / OpenAI): `temperature == 0` means greedy; `top_k=None`,
`top_p=1.0` and `min_p=0.0` disable those filters; penalties at their neutral values disable them.
`n` is for whoever fans a prompt out (the offline `LLM`, the OpenAI front): one engine sequence
always generates one completion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_N = 64


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

    def __post_init__(self):
        # Lists are accepted for convenience and frozen into tuples so params stay hashable.
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"must be None or an integer in [0, {MAX_LOGPROBS}]",
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
