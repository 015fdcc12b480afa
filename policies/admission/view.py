"""What admission decides on: the request and a snapshot of the cluster, as plain immutable data.

The router fills these from its live state right before calling `AdmissionPolicy.decide`:
* `AdmissionRequest.from_router_request(request, cached)` from the validated `RouterRequest`;
* `ClusterView.prefill_workers`: the candidate prefill workers' `WorkerLoad`s (the same figures the
  routing policy sees). `num_cached_tokens_expected` is the prefix the router expects on the worker it
  will route to: pass the routed worker alone for an exact prediction, or every healthy worker and the
  longest expected prefix for an optimistic one before routing;
* `ClusterView.decode_instances`: each healthy decode instance's sequences and KV blocks. Requests
  reserved there but not adopted yet are passed as running with `generated_tokens=0`;
* the fitted cost models' snapshots (`PrefillCostModel.fit()` …) and the pool constants; `ttft_fit`
  (the router's own observed-TTFT model) defaults to its zero prior, which leaves the step models alone.
Construction validates the fields (ValueError naming the field): a view that builds is a valid view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from policies.admission.cost_model import (
    OBSERVED_TTFT_PRIOR,
    DecodeStepFit,
    ObservedTtftFit,
    PrefillTimeFit,
    TransferTimeFit,
)
from policies.routing.base import WorkerLoad


@dataclass(frozen=True)
class AdmissionRequest:
    num_prompt_tokens: int
    num_cached_tokens_expected: int  # prompt tokens the chosen prefill worker is expected to hold
    max_tokens: int
    ttft_ms: float | None  # the request's own SLO; None: its priority's default
    tpot_ms: float | None
    priority: int  # higher is more important
    waited_s: float = 0.0  # time since its client sent it: already part of the TTFT the client will see

    def __post_init__(self):
        _check(self.num_prompt_tokens >= 1, "num_prompt_tokens", "must be >= 1")
        _check(
            0 <= self.num_cached_tokens_expected <= self.num_prompt_tokens,
            "num_cached_tokens_expected",
            f"must be in [0, num_prompt_tokens={self.num_prompt_tokens}]",
        )
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(math.isfinite(self.waited_s) and self.waited_s >= 0, "waited_s", "must be finite and >= 0")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            _check(value is None or (math.isfinite(value) and value > 0), name, "must be None or finite and > 0")

    @property
    def uncached_prompt_tokens(self) -> int:
        # The last prompt token is always computed, cached or not: it yields the first output token.
        return max(self.num_prompt_tokens - self.num_cached_tokens_expected, 1)

    @classmethod
    def from_router_request(
        cls, request, num_cached_tokens_expected: int = 0, waited_s: float = 0.0
    ) -> AdmissionRequest:
        """From a `router.validation.RouterRequest` (duck-typed: only its fields are read)."""
        return cls(
            len(request.prompt_token_ids),
            num_cached_tokens_expected,
            request.params.max_tokens,
            request.ttft_ms,
            request.tpot_ms,
            request.priority,
            waited_s,
        )


class RunningRequest(NamedTuple):
    generated_tokens: int  # output tokens so far
    max_tokens: int  # the request's limit: it leaves the batch at the latest after this many
    context_tokens: int  # prompt + generated: the KV its next decode step reads


@dataclass(frozen=True)
class DecodeInstanceView:
    instance_id: str
    running: tuple[RunningRequest, ...]
    kv_blocks_free: int
    kv_blocks_total: int

    def __post_init__(self):
        object.__setattr__(self, "running", tuple(self.running))  # a list from live state is fine too
        _check(self.kv_blocks_total >= 1, f"decode[{self.instance_id}].kv_blocks_total", "must be >= 1")
        _check(
            0 <= self.kv_blocks_free <= self.kv_blocks_total,
            f"decode[{self.instance_id}].kv_blocks_free",
            f"must be in [0, kv_blocks_total={self.kv_blocks_total}]",
        )

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total


@dataclass(frozen=True)
class ClusterView:
    prefill_workers: tuple[WorkerLoad, ...]
    decode_instances: tuple[DecodeInstanceView, ...]
    prefill_fit: PrefillTimeFit
    decode_fit: DecodeStepFit
    transfer_fit: TransferTimeFit
    kv_bytes_per_token: int  # KV of one token over all layers, as it crosses the wire
    block_size_tokens: int
    prefill_step_budget_tokens: int  # tokens a prefill step batches at most (max_num_batched_tokens)
    ttft_fit: ObservedTtftFit = OBSERVED_TTFT_PRIOR

    def __post_init__(self):
        object.__setattr__(self, "prefill_workers", tuple(self.prefill_workers))
        object.__setattr__(self, "decode_instances", tuple(self.decode_instances))
        _check(self.kv_bytes_per_token >= 0, "kv_bytes_per_token", "must be >= 0")
        _check(self.block_size_tokens >= 1, "block_size_tokens", "must be >= 1")
        _check(self.prefill_step_budget_tokens >= 1, "prefill_step_budget_tokens", "must be >= 1")
        for worker in self.prefill_workers:
            _check(
                worker.queued_prompt_tokens >= 0 and worker.inflight_requests >= 0,
                f"prefill[{worker.worker_id}]",
                "load figures must be >= 0",
            )
        for name in ("prefill_fit", "decode_fit", "transfer_fit", "ttft_fit"):
            fit = getattr(self, name)
            _check(all(math.isfinite(c) and c >= 0 for c in fit), name, f"coefficients must be finite and >= 0: {fit}")

    def blocks_needed(self, request: AdmissionRequest) -> int:
        """KV blocks a decode instance reserves for the request: its prompt and first token."""
        return -(-(request.num_prompt_tokens + 1) // self.block_size_tokens)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}")
