"""What the offline API returns per prompt."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time_s: float
    first_token_time_s: float | None
    token_times_s: tuple[float, ...]  # perf_counter time each output token was produced
    # Speculative decoding: verify steps this sequence took part in with drafts, drafts proposed, and
    # drafts accepted (0 without speculation).
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed drafts; None when nothing was proposed."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts + the target's token); None without one."""
        return 1 + self.spec_accepted_tokens / self.spec_steps if self.spec_steps else None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time_s is None else self.first_token_time_s - self.arrival_time_s

    @property
    def inter_token_latencies_s(self) -> tuple[float, ...]:
        times = self.token_times_s
        return tuple(later - earlier for earlier, later in itertools.pairwise(times))

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        gaps = self.inter_token_latencies_s
        return sum(gaps) / len(gaps) if gaps else None


@dataclass(frozen=True)
class CompletionOutput:
    """One of a prompt's n completions (vLLM's shape)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    metrics: RequestMetrics
    logprobs: tuple | None = None  # per token: engine.sampler.TokenLogprobs, when requested


@dataclass(frozen=True)
class RequestOutput:
    """A prompt and its completions, `outputs[0..n)`. The flat fields (`text`, `token_ids`,
    `finish_reason`, `logprobs`, `metrics`, `ttft_s`) are the first completion's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    num_cached_tokens: int
    # params.prompt_logprobs: None for the first prompt token, then an engine.sampler.TokenLogprobs each
    prompt_logprobs: tuple | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> tuple | None:
        return self.outputs[0].logprobs

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics

    @property
    def ttft_s(self) -> float | None:
        return self.metrics.ttft_s
