"""The admission gate: builds the admission policy's `ClusterView` from what the router knows, and
keeps the cost models fitted from the workers' reported engine steps. The router owns one
(router/service.py); the fleet simulator owns one too and feeds it the same figures from its
simulated workers (sim/admission.py), so both decide with the same objects.

What the view holds, and where it comes from:
* the chosen prefill worker's queued uncached tokens and in-flight requests — the router's own count;
* the chosen decode instance's running requests (tokens generated so far, max_tokens, context) — the
  router streams every token, so it knows them exactly; KV blocks free / total — the worker monitor;
* prefill, decode-step and transfer cost models — fitted online from the `steps` each worker reports
  in `stats()` (new records only, by index) and from the hand-off figures of finished requests;
* the observed-TTFT model — fitted from the router's own admitted requests: the uncached tokens
  queued on the worker at admission (its own included) against the TTFT the router then saw. It
  covers what engine steps do not show (Ray and router overhead, a prefill pool held by hand-offs);
  the predictor takes the larger of its prediction and the step models' (`admission.predictor`).
The decision is made after routing and before any worker is touched; a rejection costs no block.
`decide` takes the router's request (duck-typed: `AdmissionRequest.from_router_request` reads it);
`decide_request` takes an `AdmissionRequest` built by the caller (the simulator's).
"""

from __future__ import annotations

from policies.admission import (
    AdmissionConfig,
    AdmissionDecision,
    AdmissionRequest,
    ClusterView,
    DecodeCostModel,
    DecodeInstanceView,
    DecodeStep,
    ObservedTtftModel,
    PrefillCostModel,
    PrefillStep,
    RunningRequest,
    TransferCostModel,
    TransferStep,
    TtftSample,
    policy_from_config,
)
from policies.admission.step_stats import unseen_steps
from policies.routing import WorkerLoad

# The observed-TTFT model tracks the regime now: its window (requests, not steps) forgets an overload
# that has passed within a few seconds of traffic, where the step models' longer windows keep history.
OBSERVED_TTFT_WINDOW = 64


class AdmissionGate:
    def __init__(
        self, config: AdmissionConfig, kv_bytes_per_token: int, block_size: int, prefill_step_budget_tokens: int
    ):
        self.config = config
        self.policy = policy_from_config(config)
        window, minimum = config.cost_window_steps, config.cost_min_samples
        self.prefill_cost = PrefillCostModel(window_steps=window, min_samples=minimum)
        self.decode_cost = DecodeCostModel(window_steps=window, min_samples=minimum)
        self.transfer_cost = TransferCostModel(window_steps=window, min_samples=minimum)
        self.ttft_cost = ObservedTtftModel(
            window_steps=min(window, OBSERVED_TTFT_WINDOW), min_samples=min(minimum, OBSERVED_TTFT_WINDOW)
        )
        self._seen_step: dict[tuple[str, int], int] = {}  # (worker id, epoch) → newest step index read
        self.kv_bytes_per_token, self.block_size = kv_bytes_per_token, block_size
        self.prefill_step_budget_tokens = prefill_step_budget_tokens

    def observe_ttft(self, tokens_through: int, observed_s: float) -> None:
        """An admitted request's first token came `observed_s` after it reached the router; when it was
        admitted, `tokens_through` uncached tokens were queued on its prefill worker, its own included."""
        self.ttft_cost.observe(TtftSample(tokens_through, observed_s))

    def observe_handoff(self, stats) -> None:
        """A finished prefill → decode KV hand-off (kvtransfer.session.HandoffStats): the transfer model."""
        self.transfer_cost.observe(TransferStep(stats.num_bytes, stats.elapsed_s))

    def observe_stats(self, worker_id: str, role: str, epoch: int, stats) -> None:
        """Feeds a worker's newly reported steps (WorkerStats.steps: index, duration_s, tokens, seqs,
        context) to its role's model. Step indexes restart with each start (epoch) of a worker."""
        key = (worker_id, epoch)
        steps = unseen_steps(stats, self._seen_step.get(key, 0))
        for _, duration_s, num_tokens, num_seqs, context_tokens in steps:
            if role == "prefill":
                self.prefill_cost.observe(PrefillStep(num_tokens, duration_s))
            else:
                self.decode_cost.observe(DecodeStep(num_seqs, context_tokens, duration_s))
        if steps:
            self._seen_step[key] = steps[-1][0]

    def decide(
        self,
        request,
        expected_cached_tokens: int,
        prefill: WorkerLoad,
        decode_id: str,
        decode_running: list[RunningRequest],
        blocks_reported_free: int,
        decode_blocks_total: int,
        waited_s: float = 0.0,
    ) -> AdmissionDecision:
        """`request`: anything with the fields `AdmissionRequest.from_router_request` reads."""
        cached = min(expected_cached_tokens, len(request.prompt_token_ids))
        return self.decide_request(
            AdmissionRequest.from_router_request(request, cached, waited_s),
            prefill,
            decode_id,
            decode_running,
            blocks_reported_free,
            decode_blocks_total,
        )

    def decide_request(
        self,
        request: AdmissionRequest,
        prefill: WorkerLoad,
        decode_id: str,
        decode_running: list[RunningRequest],
        blocks_reported_free: int,
        decode_blocks_total: int,
    ) -> AdmissionDecision:
        """The policy's decision on `request` routed to `prefill` and the decode instance `decode_id`."""
        return self.policy.decide(
            request, self.view(prefill, decode_id, decode_running, blocks_reported_free, decode_blocks_total)
        )

    def view(
        self,
        prefill: WorkerLoad,
        decode_id: str,
        decode_running: list[RunningRequest],
        blocks_reported_free: int,
        decode_blocks_total: int,
    ) -> ClusterView:
        """The policy's view: the chosen workers, the current fits and the pool constants. The decode
        instance's free blocks are its reported count (up to a probe interval old), or fewer when the
        requests routed there since already need more: what the caller placed there is exact."""
        held = sum(-(-(r.context_tokens + 1) // self.block_size) for r in decode_running)
        blocks_free = max(min(blocks_reported_free, decode_blocks_total - held), 0)
        return ClusterView(
            (prefill,),
            (DecodeInstanceView(decode_id, tuple(decode_running), blocks_free, decode_blocks_total),),
            self.prefill_cost.fit(),
            self.decode_cost.fit(),
            self.transfer_cost.fit(),
            self.kv_bytes_per_token,
            self.block_size,
            self.prefill_step_budget_tokens,
            self.ttft_cost.fit(),
        )
