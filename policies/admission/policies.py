"""The simple admission policies: `always` and `threshold` (load limits); `predictive` has its own file.

`threshold` sheds lower priorities first by scaling each limit with `AdmissionConfig.headroom`, so as
load rises the lowest priority's limit is reached first. It judges the load already there, not the
request's own size, so an idle cluster admits every request whose KV blocks fit somewhere.
"""

from __future__ import annotations

import math

from policies.admission.base import AdmissionDecision, AdmissionPolicy, Cause, admit, reject
from policies.admission.decode_projection import first_finish_s
from policies.admission.predictor import decode_candidates, drain_time_s
from policies.admission.view import AdmissionRequest, ClusterView
from policies.routing.base import least_loaded


class AlwaysAdmitPolicy(AdmissionPolicy):
    """Admits everything (the default: admission off, routing and the router's own limits decide)."""

    name = "always"

    def decide(self, request: AdmissionRequest, view: ClusterView) -> AdmissionDecision:
        return admit("admission control is off (policy always)")


class ThresholdPolicy(AdmissionPolicy):
    """Rejects when the load already on the best candidates is at or above its limit × headroom:
    the least-loaded prefill worker's queued uncached tokens against `max_queued_prompt_tokens`; then,
    over the decode instances with free blocks for the request, their sequences against
    `max_running_requests` and their KV usage against `max_kv_usage` (one instance under both admits)."""

    name = "threshold"

    def decide(self, request: AdmissionRequest, view: ClusterView) -> AdmissionDecision:
        missing = self.no_workers(view)
        if missing is not None:
            return missing
        headroom = self.config.headroom(request.priority)
        worker = least_loaded(view.prefill_workers)
        limit = self.config.max_queued_prompt_tokens * headroom
        if worker.queued_prompt_tokens >= limit:
            excess = math.floor(worker.queued_prompt_tokens - limit) + 1  # drained, the queue is below the limit
            wait_s = drain_time_s(excess, view.prefill_fit, view.prefill_step_budget_tokens)
            return reject(
                Cause.QUEUED_TOKENS,
                f"the least-loaded prefill worker {worker.worker_id} already has "
                f"{worker.queued_prompt_tokens} uncached prompt tokens queued; the limit for priority "
                f"{request.priority} is {limit:g} ({self._share(headroom)})",
                self.retry_after(wait_s),
            )
        return self._decode_side(request, view, headroom)

    def _decode_side(self, request: AdmissionRequest, view: ClusterView, headroom: float) -> AdmissionDecision:
        fits = decode_candidates(request, view)
        if not fits:
            return self.kv_blocks_rejection(request, view)
        max_running = self.config.max_running_requests * headroom
        room = [d for d in fits if len(d.running) < max_running]
        if not room:
            fewest = min(len(d.running) for d in fits)
            return reject(
                Cause.RUNNING_REQUESTS,
                f"every decode instance with room already runs {fewest} or more "
                f"sequences; the limit for priority {request.priority} is {max_running:g} "
                f"({self._share(headroom)})",
                self._wait_for_a_finish(view),
            )
        max_usage = self.config.max_kv_usage * headroom
        lowest = min(d.kv_usage for d in room)
        if lowest >= max_usage:
            return reject(
                Cause.KV_USAGE,
                f"every decode instance with room already has {lowest:.0%} or more of its "
                f"KV blocks in use; the limit for priority {request.priority} is {max_usage:.0%} "
                f"({self._share(headroom)})",
                self._wait_for_a_finish(view),
            )
        return admit("within the load limits")

    def _wait_for_a_finish(self, view: ClusterView) -> float:
        waits = [first_finish_s(d.running, view.decode_fit) for d in view.decode_instances]
        return self.retry_after(min((w for w in waits if w is not None), default=None))

    @staticmethod
    def _share(headroom: float) -> str:
        return f"{headroom:.0%} of the configured limit"
