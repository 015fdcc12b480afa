"""Whether the chosen prefill worker should pull a prompt's prefix from a peer instead of computing it.

The routing policy picks a worker by one cost (its queue plus the tokens it would compute). When that
worker holds fewer of the prompt's leading blocks than the best holder the prefix index knows (the
holder is busier, so it lost on cost), the difference can be pulled from the holder over the KV
transport (prefill_worker/prefix_pull.py). Mode "auto" pulls when

    pull_s(bytes of the missing blocks)  <  prefill_s(uncached tokens without it) - prefill_s(with it)

with prefill_s fitted online from the prefill workers' reported engine steps (the admission cost
model's shape) and pull_s fitted (latency + bytes / bandwidth) from every KV transfer that finished:
the prefill → decode hand-off of each request moves KV over the same transport, so the model learns
the link before the first pull, and pulls add their own samples. Until enough transfers were seen,
pull_s uses PULL_PRIOR: 20 ms for the two Ray round trips, the engine-thread
hops and the channel, and 0.5 GB/s — what `benchmarks.bench_pull` measured for whole pulls on the
busy 2-core VM (a 3 MB pull took ~20 ms; raw gloo moves 2.4-3.4 GB/s on loopback), so a cold
router errs towards recomputing yet still pulls prefixes of a few blocks of a real model.
Mode "always" pulls whenever the holder has more (tests, benchmarks); "never" turns pulls off.
It lives below the router so that the fleet simulator (sim/) runs the same decisions, fed by its own
modelled steps and transfers.
"""

from __future__ import annotations

from collections.abc import Collection

from common.messages import PrefixPull, PullOutcome
from policies.admission import PrefillCostModel, PrefillStep
from policies.admission.cost_model import TransferCostModel, TransferTimeFit
from policies.admission.step_stats import TransferStep, unseen_steps
from policies.routing import RouteDecision, RouteQuery

PULL_PRIOR = TransferTimeFit(latency_s=0.020, per_byte_s=2e-9)
MODES = ("auto", "always", "never")


class PullPlanner:
    def __init__(self, mode: str, kv_bytes_per_token: int, prefill_cost: PrefillCostModel | None = None):
        """`prefill_cost`: a model someone else feeds (the admission gate's); None: an own one, fed by
        `observe_stats`."""
        if mode not in MODES:
            raise ValueError(f"unknown prefix pull mode {mode!r}; known: {', '.join(MODES)}")
        self.mode, self.kv_bytes_per_token = mode, kv_bytes_per_token
        self.prefill_cost = prefill_cost if prefill_cost is not None else PrefillCostModel()
        self.pull_cost = TransferCostModel(prior=PULL_PRIOR)
        self._seen_step: dict[tuple[str, int], int] = {}  # (worker id, epoch) → newest step index read

    def plan(self, query: RouteQuery, decision: RouteDecision, healthy_ids: Collection[str]) -> PrefixPull | None:
        """The pull the chosen worker should do before computing this prompt, or None."""
        if self.mode == "never" or decision.holder_id in (None, decision.worker_id):
            return None
        if decision.holder_id not in healthy_ids:
            return None
        max_blocks = (query.num_prompt_tokens - 1) // query.block_size  # the last token is always computed
        holder_blocks = min(decision.holder_blocks, max_blocks)
        missing_blocks = holder_blocks - decision.expected_cached_blocks
        if missing_blocks <= 0:
            return None
        if self.mode == "auto" and self.pull_s(missing_blocks, query.block_size) >= self.saved_s(
            query, decision.expected_cached_blocks, holder_blocks
        ):
            return None
        return PrefixPull(decision.holder_id, holder_blocks)

    def pull_s(self, num_blocks: int, block_size: int) -> float:
        """Estimated time to pull `num_blocks` blocks."""
        return self.pull_cost.fit().time_s(num_blocks * block_size * self.kv_bytes_per_token)

    def saved_s(self, query: RouteQuery, cached_blocks: int, pulled_blocks: int) -> float:
        """Estimated prefill time saved by having `pulled_blocks` instead of `cached_blocks` cached."""
        fit = self.prefill_cost.fit()
        without = max(query.num_prompt_tokens - cached_blocks * query.block_size, 1)
        with_pull = max(query.num_prompt_tokens - pulled_blocks * query.block_size, 1)
        return fit.time_s(without) - fit.time_s(with_pull)

    def observe_pull(self, outcome: PullOutcome) -> None:
        """A finished pull: feeds the transfer model (failed or empty pulls carry no timing)."""
        if outcome.num_blocks > 0:
            self.observe_transfer(outcome.num_bytes, outcome.duration_s)

    def observe_transfer(self, num_bytes: int, duration_s: float) -> None:
        """Any finished KV transfer (a hand-off's HandoffStats, a pull)."""
        self.pull_cost.observe(TransferStep(num_bytes, duration_s))

    def observe_stats(self, worker_id: str, role: str, epoch: int, stats) -> None:
        """WorkerMonitor listener: feeds a prefill worker's newly reported engine steps (WorkerStats) to the
        prefill model."""
        if role != "prefill":
            return
        key = (worker_id, epoch)
        steps = unseen_steps(stats, self._seen_step.get(key, 0))
        for _, duration_s, num_tokens, _, _ in steps:
            self.prefill_cost.observe(PrefillStep(num_tokens, duration_s))
        if steps:
            self._seen_step[key] = steps[-1][0]
