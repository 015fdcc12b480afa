"""A benchmark request and the throughput record of a run over such requests: the terms in which
`benchmarks/bench_engine.py` compares the engine with its HF baseline (benchmarks/hf_baseline.py).

`Throughput` counts useful output (each request's own max_tokens) apart from what a runner computed
(padding rows and batch overrun included), so static batching's waste shows instead of flattering it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple


class BenchRequest(NamedTuple):
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Throughput:
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # useful output: each request's own max_tokens
    computed_output_tokens: int  # what the runner decoded, padding rows and batch overrun included
    wall_s: float

    @classmethod
    def of(cls, requests: list[BenchRequest], computed_output_tokens: int, wall_s: float) -> Throughput:
        return cls(
            len(requests),
            sum(len(r.prompt_token_ids) for r in requests),
            sum(r.max_tokens for r in requests),
            computed_output_tokens,
            wall_s,
        )

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def __add__(self, other: Throughput) -> Throughput:
        return Throughput(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values(), strict=True)))

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }
