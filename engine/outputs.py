"""What the offline API returns per prompt."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time_s: float
    first_token_time_s: float | None
    token_times_s: tuple[float, ...]  # perf_counter time each output token was produced

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time_s is None else self.first_token_time_s - self.arrival_time_s

    @property
    def inter_token_latencies_s(self) -> tuple[float, ...]:
        times = self.token_times_s
        return tuple(later - earlier for earlier, later in zip(times, times[1:]))

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        gaps = self.inter_token_latencies_s
        return sum(gaps) / len(gaps) if gaps else None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    num_cached_tokens: int
    metrics: RequestMetrics
    logprobs: tuple | None = None  # per token: engine.sampler.TokenLogprobs, when requested

    @property
    def ttft_s(self) -> float | None:
        return self.metrics.ttft_s
