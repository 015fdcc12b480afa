"""The admission-policy interface: admit a request now, or reject it early with a reason.

Contract (every implementation; tests/policies/test_admission_contract.py runs each against it):
* `decide(request, view)` returns an `AdmissionDecision` for any valid `AdmissionRequest` and
  `ClusterView` (one that constructed without error), including views without workers; it never
  raises on them.
* It is a pure function of its inputs and the policy's config: deterministic, no I/O, no clock, no
  randomness, no blocking. The router calls it on its event loop for every request.
* `admit=True`: `retry_after_s` is None and `cause` is `Cause.ADMITTED`.
  `admit=False`: `reason` says in words which limit was hit, by how much, for which priority (it goes
  to the client in RESOURCE_EXHAUSTED); `cause` names the limit with a fixed label (for metrics);
  `retry_after_s` is the suggested wait in seconds (> 0, finite), or None when waiting cannot help
  (the request cannot meet its SLO even on an idle cluster, or its blocks can never be free).
* `prediction` is the predictor's view of the request: set by `predictive` once it has predicted
  both TTFT and TPOT (admits, and TPOT rejections), None otherwise.
* Decisions do not reserve anything: the router reserves decode blocks after an admit.
* Policies are owned by one router and used from its event loop only: no locking. They hold no
  state but their config; `check_integrity()` raises AssertionError on inconsistent state.
A view without prefill workers or decode instances is rejected (`Cause.NO_WORKERS`) by policies that
look at load; a router that wants UNAVAILABLE for that case raises `NoWorkersError` before asking.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum
from typing import ClassVar, NamedTuple

from common.admission_config import AdmissionConfig, Slo
from policies.admission.decode_projection import time_until_blocks_free_s
from policies.admission.predictor import Prediction
from policies.admission.view import AdmissionRequest, ClusterView


class Cause(StrEnum):
    ADMITTED = "admitted"
    NO_WORKERS = "no_workers"
    QUEUED_TOKENS = "queued_tokens"
    RUNNING_REQUESTS = "running_requests"
    KV_USAGE = "kv_usage"
    KV_BLOCKS = "kv_blocks"
    TTFT = "ttft"
    TPOT = "tpot"


class AdmissionDecision(NamedTuple):
    admit: bool
    reason: str  # why, in words: the client sees it on a rejection
    retry_after_s: float | None  # rejections: suggested wait; None when waiting cannot help
    prediction: Prediction | None
    cause: Cause


class AdmissionPolicy(ABC):
    name: ClassVar[str]

    def __init__(self, config: AdmissionConfig | None = None):
        self.config = config or AdmissionConfig()

    @abstractmethod
    def decide(self, request: AdmissionRequest, view: ClusterView) -> AdmissionDecision:
        """Admit or reject `request` given `view` (see the module contract)."""

    def check_integrity(self) -> None:
        """Raises AssertionError if internal state is inconsistent; the shipped policies hold none."""
        assert isinstance(self.config, AdmissionConfig)

    def slo(self, request: AdmissionRequest) -> Slo:
        """The request's own SLO where it set one, its priority class's default otherwise."""
        default = self.config.slo_for(request.priority)
        return Slo(
            request.ttft_ms if request.ttft_ms is not None else default.ttft_ms,
            request.tpot_ms if request.tpot_ms is not None else default.tpot_ms,
        )

    def retry_after(self, wait_s: float | None) -> float:
        """A rejection's wait: the estimate floored at `min_retry_after_s`, or the configured default."""
        return self.config.retry_after_s if wait_s is None else max(wait_s, self.config.min_retry_after_s)

    def no_workers(self, view: ClusterView) -> AdmissionDecision | None:
        """A rejection when the view lacks a pool to place the request on, else None."""
        for pool, members in (("prefill worker", view.prefill_workers), ("decode instance", view.decode_instances)):
            if not members:
                return reject(Cause.NO_WORKERS, f"no healthy {pool} to place the request on", self.config.retry_after_s)
        return None

    def kv_blocks_rejection(self, request: AdmissionRequest, view: ClusterView) -> AdmissionDecision:
        """No decode instance can reserve the request's blocks now: wait until one is projected to."""
        needed = view.blocks_needed(request)
        waits = [
            time_until_blocks_free_s(
                d.running, view.decode_fit, d.kv_blocks_free, d.kv_blocks_total, view.block_size_tokens, needed
            )
            for d in view.decode_instances
        ]
        known = [w for w in waits if w is not None]
        return reject(
            Cause.KV_BLOCKS,
            f"no decode instance has the {needed} free KV blocks the request needs",
            self.retry_after(min(known)) if known else None,
        )


def admit(reason: str, prediction: Prediction | None = None) -> AdmissionDecision:
    return AdmissionDecision(True, reason, None, prediction, Cause.ADMITTED)


def reject(
    cause: Cause, reason: str, retry_after_s: float | None, prediction: Prediction | None = None
) -> AdmissionDecision:
    return AdmissionDecision(False, reason, retry_after_s, prediction, cause)


def ms(seconds: float) -> str:
    """Milliseconds for a reason string: whole from 100 ms, one decimal below (TPOTs live there)."""
    value = seconds * 1000.0
    return f"{value:.0f} ms" if value >= 100 else f"{value:.1f} ms"
