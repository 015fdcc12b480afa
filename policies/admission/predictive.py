"""`predictive`: admit iff the predicted TTFT and TPOT meet the request's SLO, with a margin, and
with less room for load the lower the priority (Mooncake-style early rejection on predicted, not
current, load; the predictions are `predictor`'s).

For each of TTFT and TPOT, with budget = SLO · slo_margin and alone = the prediction on an idle
cluster (TTFT: the request's own prefill; TPOT: a decode step with it alone):

    alone > budget                                   → reject for good (retry_after_s None)
    predicted ≤ alone + headroom(p) · (budget − alone) → within budget

The load on the cluster — prefill queued ahead, sequences sharing the decode step — may take only the
priority's headroom share of the room between what the request needs alone and its budget. So an
idle cluster admits every priority alike (predicted = alone), and as load rises the lowest priority
runs out of room first. TTFT is checked on the fastest prefill worker, TPOT at join time on the
fastest decode instance with room for the request's blocks.
"""

from __future__ import annotations

from policies.admission.base import AdmissionDecision, AdmissionPolicy, Cause, admit, ms, reject
from policies.admission.decode_projection import time_until_step_within_s
from policies.admission.predictor import (
    TpotPrediction,
    TtftPrediction,
    best_decode,
    best_prefill,
    combine,
    decode_candidates,
    ttft_alone_s,
)
from policies.admission.view import AdmissionRequest, ClusterView


class PredictivePolicy(AdmissionPolicy):
    name = "predictive"

    def decide(self, request: AdmissionRequest, view: ClusterView) -> AdmissionDecision:
        missing = self.no_workers(view)
        if missing is not None:
            return missing
        slo = self.slo(request)
        ttft = best_prefill(request, view)
        assert ttft is not None, "no_workers() above"
        alone_s = ttft_alone_s(request, view)
        allowed_s, rule = self._allowance(alone_s, slo.ttft_ms, request.priority)
        if alone_s > allowed_s:
            return reject(
                Cause.TTFT,
                f"its {request.uncached_prompt_tokens} uncached prompt tokens alone take a "
                f"predicted {ms(alone_s)} to prefill, more than {rule}",
                None,
            )
        if ttft.ttft_s > allowed_s:
            return self._ttft_rejection(ttft, allowed_s, rule)
        tpot = best_decode(request, view, ttft.join_s)
        if tpot is None:
            return self.kv_blocks_rejection(request, view)
        return self._check_tpot(request, view, ttft, tpot, slo.tpot_ms)

    def _check_tpot(
        self, request: AdmissionRequest, view: ClusterView, ttft: TtftPrediction, tpot: TpotPrediction, slo_ms: float
    ) -> AdmissionDecision:
        prediction = combine(ttft, tpot)
        newcomer_context = request.num_prompt_tokens + 1
        alone_s = view.decode_fit.step_time_s(1, newcomer_context)
        allowed_s, rule = self._allowance(alone_s, slo_ms, request.priority)
        if alone_s > allowed_s:
            return reject(
                Cause.TPOT,
                f"a decode step with this request alone takes a predicted {ms(alone_s)}, more than {rule}",
                None,
                prediction,
            )
        if tpot.tpot_s > allowed_s:
            moments = [
                time_until_step_within_s(d.running, view.decode_fit, newcomer_context, allowed_s)
                for d in decode_candidates(request, view)
            ]
            # Retrying after w joins at w + join_s: the batch must have shrunk by then, not by now.
            wait_s = min((m for m in moments if m is not None), default=None)
            return reject(
                Cause.TPOT,
                f"predicted TPOT {ms(tpot.tpot_s)} (decode batch of {tpot.batch_size} when it "
                f"joins {tpot.instance_id}) exceeds {rule}",
                None if wait_s is None else self.retry_after(wait_s - ttft.join_s),
                prediction,
            )
        return admit(f"predicted TTFT {ms(ttft.ttft_s)} and TPOT {ms(tpot.tpot_s)} are within budget", prediction)

    def _ttft_rejection(self, ttft: TtftPrediction, allowed_s: float, rule: str) -> AdmissionDecision:
        # The worker works its queue off at one second per second, so the excess is the wait (a retry
        # is a new send: the time this one waited before the router does not recur).
        behind = f"waiting behind the prefill queued on {ttft.worker_id}"
        if ttft.waited_s > 0:
            parts = (
                f"{ms(ttft.waited_s)} of it spent before reaching the router, "
                f"{ms(ttft.queue_s - ttft.waited_s)} {behind}"
            )
        else:
            parts = f"{ms(ttft.queue_s)} of it {behind}"
        return reject(
            Cause.TTFT,
            f"predicted TTFT {ms(ttft.ttft_s)} ({parts}) exceeds {rule}",
            self.retry_after(ttft.ttft_s - ttft.waited_s - allowed_s),
        )

    def _allowance(self, alone_s: float, slo_ms: float, priority: int) -> tuple[float, str]:
        """(the most a prediction may be, the rule in words); below `alone_s` when even that is too much."""
        budget_s = slo_ms / 1000.0 * self.config.slo_margin
        headroom = self.config.headroom(priority)
        words = f"SLO {slo_ms:g} ms × margin {self.config.slo_margin:g}"
        if alone_s > budget_s:
            return budget_s, f"the budget of {ms(budget_s)} ({words})"
        allowed_s = alone_s + headroom * (budget_s - alone_s)
        return allowed_s, (
            f"the {ms(allowed_s)} allowed for priority {priority}: {ms(alone_s)} alone + "
            f"{headroom:.0%} of the room up to the budget of {ms(budget_s)} ({words})"
        )
