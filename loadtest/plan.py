"""What every workload produces: a `Plan` of `PlannedRequest`s, built against the model's `ModelLimits`.

A planned request's prompt is token ids (never text), so its length is exact; every id is in
[0, vocab_size) and none is an EOS id; prompt + max_tokens never exceeds max_model_len.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelLimits:
    """The served model's limits, as the router's `ModelInfo` states them."""

    max_model_len: int  # prompt plus output tokens
    vocab_size: int
    block_size: int  # tokens per KV block
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt and one output token), got {self.max_model_len}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.vocab_size - len({i for i in self.eos_token_ids if 0 <= i < self.vocab_size}) < 1:
            raise ValueError(f"vocab_size {self.vocab_size} leaves no token id that is not an EOS id")

    @property
    def ordinary_token_ids(self) -> tuple[int, ...]:
        """Ids a synthetic prompt may use: the vocabulary less the EOS ids (the router tells no other
        special ids, and with ignore_eos set nothing else changes how a prompt is served)."""
        excluded = set(self.eos_token_ids)
        return tuple(i for i in range(self.vocab_size) if i not in excluded)

    @staticmethod
    def from_model_info(info) -> ModelLimits:
        """From the SDK's `ModelInfo` (`AsyncClient.model_info()`)."""
        return ModelLimits(info.max_model_len, info.vocab_size, info.block_size, tuple(info.eos_token_ids))


@dataclass(frozen=True)
class Slo:
    """Latency objectives sent with each request; None leaves the router's priority-class default and is
    not judged by the bench (see `recorder.met_slo`)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


@dataclass(frozen=True)
class RequestDefaults:
    """Fields every workload copies onto its requests unchanged."""

    slo: Slo = Slo()
    priority: int = 0
    tenant: str = ""


@dataclass(frozen=True)
class PlannedRequest:
    index: int  # position in the plan
    arrival_s: float  # offset from the run's start at which the request is due
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    slo: Slo = Slo()
    priority: int = 0
    tenant: str = ""
    # The prompt as text, where the workload has it (sharegpt) or the chat backend made it (its prepare).
    prompt_text: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Plan:
    """A workload's requests in arrival order, and facts about how they were made (`notes`, copied into
    the summary: trace rows dropped and why, time and length scaling, ...)."""

    workload: str
    requests: tuple[PlannedRequest, ...]
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        arrivals = [r.arrival_s for r in self.requests]
        if arrivals != sorted(arrivals):
            raise ValueError("a plan's requests must be in arrival order")


def rate_note(rate_per_s: float) -> float | str:
    """A rate as JSON can hold it: "inf" for an unpaced burst (JSON has no infinity)."""
    return "inf" if math.isinf(rate_per_s) else rate_per_s


def make_requests(arrivals_s, prompts, max_tokens, defaults: RequestDefaults) -> tuple[PlannedRequest, ...]:
    """Zips per-request columns into planned requests carrying the shared defaults."""
    return tuple(
        PlannedRequest(i, float(a), tuple(p), int(m), defaults.slo, defaults.priority, defaults.tenant)
        for i, (a, p, m) in enumerate(zip(arrivals_s, prompts, max_tokens, strict=True))
    )
