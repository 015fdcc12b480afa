"""Predicted TTFT and TPOT of one request on the candidate workers of a `ClusterView`.

TTFT on a prefill worker (the first token streams as soon as prefill samples it, before the KV moves:
`cluster/client.py` step 2, so the transfer is not part of TTFT) is the larger of two predictions:
    steps_s    = drain(queued + this request's uncached tokens)
    observed_s = ttft_fit(queued + this request's uncached tokens), 0 when nothing is queued
    ttft_s     = waited_s + max(steps_s, observed_s)
    prefill_s  = drain(queued + uncached) − drain(queued)   (its own share of the steps)
    queue_s    = ttft_s − prefill_s                         (everything else: waiting)
where `waited_s` is the time since the request's client sent it (`AdmissionRequest.waited_s`): TTFT is
what the client sees, and a request that waited in its client or in the router's intake has less of
its SLO left (in a burst, the last to arrive have waited longest).
where `queued` is every uncached token this router admitted to the worker and has not had a first
token back for, and drain(n) is the time the worker's prefill steps take to compute n tokens,
`budget` at a time (the step-level cost model, so a short prompt sharing a step with the queue's tail
costs only its share). The step model alone runs short under load: it sees neither the calls around
a step nor a prefill pool held by hand-offs, which lets fewer than `budget` tokens into a step
(`cost_model`: observed TTFT). The observed model alone runs short where its window has not seen a
queue that long. The maximum is right wherever either is. Then the KV moves: transfer_s = latency +
prompt bytes / bandwidth, and the sequence joins a decode instance at join_s = ttft_s − waited_s +
transfer_s from now.

TPOT on a decode instance is its step time at join_s: the running sequences are projected forward to
join_s (`decode_projection`), those that will have finished are dropped, and the newcomer (context =
prompt + its first token) is added. The decode candidates are the instances with room to reserve the
request's blocks now. Ties go to the smaller id, so predictions are deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

from policies.admission.cost_model import PrefillTimeFit
from policies.admission.decode_projection import project, step_time_with_s
from policies.admission.view import AdmissionRequest, ClusterView, DecodeInstanceView
from policies.routing.base import WorkerLoad


class TtftPrediction(NamedTuple):
    worker_id: str
    ttft_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    waited_s: float = 0.0  # of ttft_s (and queue_s): spent before the router saw the request

    @property
    def join_s(self) -> float:
        """When the sequence is expected to join its decode instance (from now)."""
        return self.ttft_s - self.waited_s + self.transfer_s


class TpotPrediction(NamedTuple):
    instance_id: str
    tpot_s: float
    batch_size: int  # sequences in the step at join time, the newcomer included
    context_tokens: int  # their contexts' sum at join time


class Prediction(NamedTuple):
    ttft_s: float
    tpot_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    prefill_worker_id: str
    decode_instance_id: str
    decode_batch_size: int
    decode_context_tokens: int


def drain_time_s(num_tokens: int, fit: PrefillTimeFit, step_budget_tokens: int) -> float:
    """Time for prefill steps of at most `step_budget_tokens` tokens each to compute `num_tokens`."""
    full_steps, rest = divmod(max(num_tokens, 0), step_budget_tokens)
    return full_steps * fit.time_s(step_budget_tokens) + fit.time_s(rest)


def ttft_alone_s(request: AdmissionRequest, view: ClusterView) -> float:
    """The request's TTFT on an idle prefill worker: the steps alone (see the module docstring)."""
    return drain_time_s(request.uncached_prompt_tokens, view.prefill_fit, view.prefill_step_budget_tokens)


def predict_ttft(request: AdmissionRequest, worker: WorkerLoad, view: ClusterView) -> TtftPrediction:
    budget = view.prefill_step_budget_tokens
    queued = worker.queued_prompt_tokens
    through = queued + request.uncached_prompt_tokens
    steps_s = drain_time_s(through, view.prefill_fit, budget)
    prefill_s = steps_s - drain_time_s(queued, view.prefill_fit, budget)
    ttft_s = request.waited_s + (max(steps_s, view.ttft_fit.time_s(through)) if queued > 0 else steps_s)
    transfer_s = view.transfer_fit.time_s(view.kv_bytes_per_token * request.num_prompt_tokens)
    return TtftPrediction(worker.worker_id, ttft_s, ttft_s - prefill_s, prefill_s, transfer_s, request.waited_s)


def best_prefill(request: AdmissionRequest, view: ClusterView) -> TtftPrediction | None:
    """The prefill worker with the smallest predicted TTFT; None without workers."""
    predictions = [predict_ttft(request, worker, view) for worker in view.prefill_workers]
    return min(predictions, key=lambda p: (p.ttft_s, p.worker_id), default=None)


def predict_tpot(
    request: AdmissionRequest, instance: DecodeInstanceView, view: ClusterView, join_s: float
) -> TpotPrediction:
    batch = project(instance.running, view.decode_fit, join_s)
    newcomer_context = request.num_prompt_tokens + 1
    tpot_s = step_time_with_s(batch, view.decode_fit, newcomer_context)
    return TpotPrediction(
        instance.instance_id, tpot_s, len(batch) + 1, sum(context for _, context in batch) + newcomer_context
    )


def decode_candidates(request: AdmissionRequest, view: ClusterView) -> tuple[DecodeInstanceView, ...]:
    """The decode instances that can reserve the request's KV blocks now."""
    needed = view.blocks_needed(request)
    return tuple(d for d in view.decode_instances if d.kv_blocks_free >= needed)


def best_decode(request: AdmissionRequest, view: ClusterView, join_s: float) -> TpotPrediction | None:
    """The candidate decode instance with the smallest predicted TPOT; None if none has room."""
    predictions = [predict_tpot(request, d, view, join_s) for d in decode_candidates(request, view)]
    return min(predictions, key=lambda p: (p.tpot_s, p.instance_id), default=None)


def predict(request: AdmissionRequest, view: ClusterView) -> Prediction | None:
    """The best prefill worker and, for its join time, the best decode instance; None if either is
    missing (no prefill worker, or no decode instance with room)."""
    ttft = best_prefill(request, view)
    tpot = best_decode(request, view, ttft.join_s) if ttft is not None else None
    if ttft is None or tpot is None:
        return None
    return combine(ttft, tpot)


def combine(ttft: TtftPrediction, tpot: TpotPrediction) -> Prediction:
    return Prediction(
        ttft.ttft_s,
        tpot.tpot_s,
        ttft.queue_s,
        ttft.prefill_s,
        ttft.transfer_s,
        ttft.worker_id,
        tpot.instance_id,
        tpot.batch_size,
        tpot.context_tokens,
    )
