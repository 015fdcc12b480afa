"""Admission in the live router: builds the admission policy's `ClusterView` from what the router
knows, and keeps the cost models fitted from the workers' reported engine steps.

What the view holds, and where it comes from:
* the chosen prefill worker's queued uncached tokens and in-flight requests — the router's own count;
* the chosen decode instance's running requests (tokens generated so far, max_tokens, context) — the
  router streams every token, so it knows them exactly; KV blocks free / total — the worker monitor;
* prefill, decode-step and transfer cost models — fitted online from the `steps` each worker reports
  in `stats()` (new records only, by index) and from the hand-off figures of finished requests.
The decision is made after routing and before any worker is touched; a rejection costs no block.

Calibration: the cost models see engine steps only, not what surrounds them (Ray calls, batching
delays, the router itself), so predicted TTFTs run short under load. The gate keeps a moving
average of observed / predicted TTFT over admitted requests (never below 1) and judges each request
against its SLO divided by that factor.
"""
from __future__ import annotations

import dataclasses

from router.admission import (AdmissionConfig, AdmissionDecision, AdmissionRequest, ClusterView,
                              DecodeCostModel, DecodeInstanceView, DecodeStep, PrefillCostModel, PrefillStep,
                              RunningRequest, TransferCostModel, policy_from_config)
from router.routing import WorkerLoad

TTFT_SCALE_WEIGHT = 0.1  # per admitted request: the factor follows load changes within ~10 requests
MAX_TTFT_SCALE = 10.0


class AdmissionGate:
    def __init__(self, config: AdmissionConfig, roles: dict[str, str], kv_bytes_per_token: int,
                 block_size: int, prefill_step_budget_tokens: int):
        self.config = config
        self.policy = policy_from_config(config)
        window, minimum = config.cost_window_steps, config.cost_min_samples
        self.prefill_cost = PrefillCostModel(window_steps=window, min_samples=minimum)
        self.decode_cost = DecodeCostModel(window_steps=window, min_samples=minimum)
        self.transfer_cost = TransferCostModel(window_steps=window, min_samples=minimum)
        self._roles = roles  # worker id → "prefill" / "decode"
        self._seen_step: dict[str, int] = {}
        self.kv_bytes_per_token, self.block_size = kv_bytes_per_token, block_size
        self.prefill_step_budget_tokens = prefill_step_budget_tokens
        self.ttft_scale = 1.0  # observed / predicted TTFT, moving average over admitted requests

    def observe_ttft(self, predicted_s: float, observed_s: float) -> None:
        if predicted_s > 0 and observed_s > 0:
            ratio = min(max(observed_s / predicted_s, 1.0), MAX_TTFT_SCALE)
            self.ttft_scale += TTFT_SCALE_WEIGHT * (ratio - self.ttft_scale)

    def observe_stats(self, worker_id: str, stats: dict) -> None:
        """Feeds a worker's newly reported steps (index, duration_s, tokens, seqs, context) to its model."""
        seen = self._seen_step.get(worker_id, 0)
        for index, duration_s, num_tokens, num_seqs, context_tokens in stats.get("steps", ()):
            if index <= seen:
                continue
            if self._roles.get(worker_id) == "prefill":
                self.prefill_cost.observe(PrefillStep(num_tokens, duration_s))
            else:
                self.decode_cost.observe(DecodeStep(num_seqs, context_tokens, duration_s))
            seen = index
        self._seen_step[worker_id] = seen

    def decide(self, request, expected_cached_tokens: int, prefill: WorkerLoad, decode_id: str,
               decode_running: list[RunningRequest], blocks_free: int, decode_blocks_total: int) -> AdmissionDecision:
        view = ClusterView((prefill,), (DecodeInstanceView(decode_id, decode_running, blocks_free,
                                                           decode_blocks_total),),
                           self.prefill_cost.fit(), self.decode_cost.fit(), self.transfer_cost.fit(),
                           self.kv_bytes_per_token, self.block_size, self.prefill_step_budget_tokens)
        cached = min(expected_cached_tokens, len(request.prompt_token_ids))
        admission = AdmissionRequest.from_router_request(request, cached)
        ttft_ms = admission.ttft_ms or self.config.slo_for(request.priority).ttft_ms
        admission = dataclasses.replace(admission, ttft_ms=ttft_ms / self.ttft_scale)
        return self.policy.decide(admission, view)
