"""A worker's Prometheus metrics (prefill worker or decode instance), one registry per worker.

Every series carries `worker` (its id) and `role` ("prefill" | "decode"), so the figures of every
worker can share one dashboard without relabelling; other labels are small fixed sets.

| metric | type | extra labels |
|---|---|---|
| splitserve_worker_kv_capacity_blocks | gauge | |
| splitserve_worker_kv_used_blocks | gauge | |
| splitserve_worker_{waiting,running}_requests | gauge | |
| splitserve_worker_prompt_tokens_total | counter | |
| splitserve_worker_prefix_cache_hit_tokens_total | counter | |
| splitserve_worker_request_queue_time_seconds | histogram | |
| splitserve_worker_preemptions_total | counter | |
| splitserve_worker_handoffs_in_flight | gauge | |
| splitserve_worker_steps_total | counter | phase (prefill, decode) |
| splitserve_worker_step_tokens_total | counter | phase |
| splitserve_worker_step_duration_seconds | histogram | phase |
| splitserve_worker_kv_transfer_bytes_total | counter | direction (send, recv) |
| splitserve_worker_kv_transfer_duration_seconds | histogram | direction |
| splitserve_worker_handoffs_total | counter | result (ok, failed, aborted) |
| splitserve_worker_spec_draft_tokens_total | counter | |
| splitserve_worker_spec_accepted_tokens_total | counter | |
| splitserve_worker_spec_verify_steps_total | counter | |
| splitserve_worker_spec_engine_steps_total | counter | switch (on, off) |
| splitserve_worker_moe_expert_tokens_total | counter | expert |
| splitserve_worker_moe_load_imbalance | gauge | layer |
| splitserve_build_info | gauge (1) | version, python_version, component |

With a `model_name`, every sample also carries `model_name` (common/metric_identity.py), as vLLM's do.
Queue time is a prefill worker's: from a request's arrival to the first step that schedules it (a
prefix pull's wait included). `handoffs_in_flight` is, on a prefill worker, hand-offs in progress; on a
decode instance, reservations whose KV has not arrived yet.

Derived figures: KV usage = kv_used_blocks / kv_capacity_blocks; prefix hit rate =
rate(prefix_cache_hit_tokens_total) / rate(prompt_tokens_total); throughput =
rate(step_tokens_total); transfer bandwidth = rate(kv_transfer_bytes_total); speculative acceptance rate =
rate(spec_accepted_tokens_total) / rate(spec_draft_tokens_total); mean accepted length (tokens per
verify step) = 1 + rate(spec_accepted_tokens_total) / rate(spec_verify_steps_total); the adaptive
switch's share of speculating steps = rate(spec_engine_steps_total{switch="on"}) / rate(...all).

Mixture-of-experts models only (the series appear with the first report): `moe_expert_tokens_total`
counts the tokens routed to each expert, summed over the MoE layers (a token counts once per expert it
chose), so rate() by expert is the load each expert (and, under expert parallelism, each rank's
slice of experts) carries; `moe_load_imbalance` is, per MoE layer, the busiest expert's tokens over
the mean expert's, over the tokens since the previous report (1: balanced; held while a layer saw
none). A decode instance's TP ranks all route every token: rank 0 reports for the instance.
Label values that come from code (phase, direction) are checked: a typo raises ValueError rather
than silently starting a new series.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metric_identity import ModelRegistry, add_build_info
from common.metrics_http import histogram_totals, plain, sample_values
from engine.speculative.counters import SpecCounters

NAMESPACE, SUBSYSTEM = "splitserve", "worker"
ROLES = ("prefill", "decode")
PHASES = ("prefill", "decode")
# pull_*: prefix blocks between prefill workers; store_in: blocks fetched from the KV tiers (kv_store/)
DIRECTIONS = ("send", "recv", "pull_out", "pull_in", "store_in")
ROLE_DIRECTIONS = {"prefill": ("send", "pull_out", "pull_in"), "decode": ("recv",)}
PULL_RESULTS = ("pulled", "skipped", "failed")
HANDOFF_RESULTS = ("ok", "failed", "aborted")
SPEC_SWITCH = ("on", "off")
# An engine step: ~1 ms (a small decode batch on a GPU) to seconds (a long chunked prefill on a CPU).
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# One sequence's KV: sub-millisecond over NVLink, seconds over gloo/TCP for long prompts.
# Waiting for a prefill slot: nothing on an idle worker, minutes behind a long queue.
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_IDENTITY = ("worker", "role")  # the first labels of every series; dropped again in snapshot()


def _check(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; known: {', '.join(allowed)}")
    return value


class WorkerMetrics:
    """One worker's metrics in a registry of its own (`registry`). Thread-safe: the engine thread,
    the KV sender/receiver threads and the actor's event loop may all update it."""

    def __init__(
        self, worker_id: str, role: str, registry: CollectorRegistry | None = None, model_name: str | None = None
    ):
        self.worker_id, self.role = worker_id, _check(role, ROLES, "role")
        if registry is None:
            registry = ModelRegistry(model_name) if model_name is not None else CollectorRegistry()
        self.registry = registry
        add_build_info(self.registry, f"{role}_worker")
        self._kv_capacity = self._gauge("kv_capacity_blocks", "KV blocks in the worker's pool.")
        self._kv_used = self._gauge("kv_used_blocks", "KV blocks held by sequences, reservations or pins.")
        self._waiting = self._gauge("waiting_requests", "Requests waiting in the worker's scheduler.")
        self._running = self._gauge("running_requests", "Requests in the worker's running batch.")
        self._prompt = self._counter(
            "prompt_tokens_total", "Prompt tokens prefilled here (a migrated request's include its streamed tokens)."
        )
        self._hits = self._counter(
            "prefix_cache_hit_tokens_total", "Of those, tokens found in the local prefix cache (not computed)."
        )
        self._queue_s = self._histogram(
            "request_queue_time_seconds",
            "Time from a request's arrival to the first engine step that schedules it.",
            (),
            QUEUE_BUCKETS_S,
        )
        self._queue_s.labels(worker_id, role)  # exported (empty) before the first request
        self._preemptions = self._counter(
            "preemptions_total", "Sequences preempted (their KV freed, recomputed later) to make room."
        )
        self._preemptions_seen = 0
        self._handoffs_in_flight = self._gauge(
            "handoffs_in_flight", "Prefill: hand-offs in progress; decode: reservations whose KV has not arrived."
        )
        self._steps = self._counter("steps_total", "Engine steps run.", ("phase",))
        self._step_tokens = self._counter("step_tokens_total", "Tokens computed by engine steps.", ("phase",))
        self._step_s = self._histogram(
            "step_duration_seconds", "Wall time of one engine step.", ("phase",), STEP_BUCKETS_S
        )
        self._transfer_bytes = self._counter(
            "kv_transfer_bytes_total", "KV payload bytes moved in hand-offs.", ("direction",)
        )
        self._transfer_s = self._histogram(
            "kv_transfer_duration_seconds",
            "Wall time of one sequence's KV transfer (send: until every rank acked).",
            ("direction",),
            TRANSFER_BUCKETS_S,
        )
        # The series this role can have exist from the start (rates read 0, and the first increase shows).
        for phase in (role,):
            for metric in (self._steps, self._step_tokens, self._step_s):
                metric.labels(worker_id, role, phase)
        for direction in ROLE_DIRECTIONS[role]:
            self._transfer_bytes.labels(worker_id, role, direction)
            self._transfer_s.labels(worker_id, role, direction)
        self._handoffs = self._counter("handoffs_total", "KV hand-offs ended, by result.", ("result",))
        for result in HANDOFF_RESULTS:  # every series exists from the start, so rate(failed) is 0, not absent
            self._handoffs.labels(worker_id, role, result)
        self._pulls = self._counter(
            "prefix_pulls_total",
            "Prefix pulls asked of this worker by the router, by result (skipped: nothing to pull or no room).",
            ("result",),
        )
        self._pulled_blocks = self._counter("prefix_pull_blocks_total", "KV blocks received by prefix pulls.")
        for result in PULL_RESULTS:
            self._pulls.labels(worker_id, role, result)
        self._spec_drafts = self._counter("spec_draft_tokens_total", "Speculative draft tokens proposed.")
        self._spec_accepted = self._counter("spec_accepted_tokens_total", "Of those, drafts the target accepted.")
        self._spec_verify = self._counter(
            "spec_verify_steps_total", "Verify steps, summed over sequences (one per sequence per step it had drafts)."
        )
        self._spec_steps = self._counter(
            "spec_engine_steps_total",
            "Engine steps with decoding sequences, by whether the adaptive switch had speculation on.",
            ("switch",),
        )
        for switch in SPEC_SWITCH:
            self._spec_steps.labels(worker_id, role, switch)
        self._spec_seen = SpecCounters()
        self._expert_tokens = self._counter(
            "moe_expert_tokens_total",
            "MoE models: tokens routed to each expert, summed over the MoE layers (once per expert a token chose).",
            ("expert",),
        )
        self._load_imbalance = Gauge(
            "moe_load_imbalance",
            "MoE models: per layer, the busiest expert's tokens over the mean expert's since the previous report.",
            (*_IDENTITY, "layer"),
            namespace=NAMESPACE,
            subsystem=SUBSYSTEM,
            registry=self.registry,
        )
        self._experts_seen: dict[int, list[int]] = {}

    def set_load(self, waiting: int, running: int, kv_used_blocks: int, kv_capacity_blocks: int) -> None:
        """The scheduler's queue lengths and the block pool's occupancy, read on the engine thread."""
        self._waiting.labels(self.worker_id, self.role).set(waiting)
        self._running.labels(self.worker_id, self.role).set(running)
        self._kv_used.labels(self.worker_id, self.role).set(kv_used_blocks)
        self._kv_capacity.labels(self.worker_id, self.role).set(kv_capacity_blocks)

    def observe_queue_time(self, seconds: float) -> None:
        """A request waited `seconds` before its first engine step."""
        self._queue_s.labels(self.worker_id, self.role).observe(seconds)

    def set_preemptions(self, total: int) -> None:
        """The scheduler's cumulative preemption count; the counter catches up."""
        self._preemptions.labels(self.worker_id, self.role).inc(max(total - self._preemptions_seen, 0))
        self._preemptions_seen = max(total, self._preemptions_seen)

    def set_handoffs_in_flight(self, count: int) -> None:
        self._handoffs_in_flight.labels(self.worker_id, self.role).set(count)

    def observe_prompt(self, context_tokens: int, cached_tokens: int) -> None:
        """A prefilled context's length (a migrated request's includes the tokens it already streamed) and
        how many of its tokens were prefix-cache hits."""
        if not 0 <= cached_tokens <= context_tokens:
            raise ValueError(f"cached tokens {cached_tokens} not in [0, {context_tokens}]")
        self._prompt.labels(self.worker_id, self.role).inc(context_tokens)
        self._hits.labels(self.worker_id, self.role).inc(cached_tokens)

    def observe_step(self, phase: str, seconds: float, num_tokens: int) -> None:
        """One engine step of `phase` that took `seconds` and computed `num_tokens` tokens."""
        labels = (self.worker_id, self.role, _check(phase, PHASES, "phase"))
        self._steps.labels(*labels).inc()
        self._step_tokens.labels(*labels).inc(num_tokens)
        self._step_s.labels(*labels).observe(seconds)

    def observe_transfer(self, direction: str, num_bytes: int, seconds: float) -> None:
        """One sequence's KV moved (`send` on prefill, `recv` on a decode rank)."""
        labels = (self.worker_id, self.role, _check(direction, DIRECTIONS, "direction"))
        self._transfer_bytes.labels(*labels).inc(num_bytes)
        self._transfer_s.labels(*labels).observe(seconds)

    def prefix_pull_finished(self, result: str, num_blocks: int) -> None:
        """A prefix pull this worker asked for ended; `num_blocks` received from the holder."""
        self._pulls.labels(self.worker_id, self.role, _check(result, PULL_RESULTS, "pull result")).inc()
        self._pulled_blocks.labels(self.worker_id, self.role).inc(num_blocks)

    def set_speculation(self, counters: SpecCounters) -> None:
        """The engine's cumulative speculative-decoding counters; the Prometheus counters catch up."""
        seen, ident = self._spec_seen, (self.worker_id, self.role)
        self._spec_drafts.labels(*ident).inc(max(counters.draft_tokens - seen.draft_tokens, 0))
        self._spec_accepted.labels(*ident).inc(max(counters.accepted_tokens - seen.accepted_tokens, 0))
        self._spec_verify.labels(*ident).inc(max(counters.sequence_steps - seen.sequence_steps, 0))
        self._spec_steps.labels(*ident, "on").inc(max(counters.steps_on - seen.steps_on, 0))
        self._spec_steps.labels(*ident, "off").inc(max(counters.steps_off - seen.steps_off, 0))
        self._spec_seen = counters

    def set_expert_load(self, counts: Mapping[int, Sequence[int]]) -> None:
        """The model's cumulative tokens per expert of each MoE layer (engine/models/moe.py
        `expert_token_counts`); the per-expert counter catches up and each layer's imbalance is taken
        over the tokens routed since the previous call."""
        ident, per_expert = (self.worker_id, self.role), dict[int, int]()
        for layer, totals in counts.items():
            seen = self._experts_seen.get(layer, [0] * len(totals))
            delta = [max(total - before, 0) for total, before in zip(totals, seen, strict=True)]
            self._experts_seen[layer] = list(totals)
            for expert, tokens in enumerate(delta):
                per_expert[expert] = per_expert.get(expert, 0) + tokens
            if sum(delta):
                self._load_imbalance.labels(*ident, str(layer)).set(max(delta) * len(delta) / sum(delta))
        for expert, tokens in sorted(per_expert.items()):
            self._expert_tokens.labels(*ident, str(expert)).inc(tokens)

    def handoff_finished(self, result: str) -> None:
        """A hand-off ended: every rank acked (ok), it failed or its lease ran out (failed), or its request
        was aborted by the caller (aborted: not a fault of either worker)."""
        self._handoffs.labels(self.worker_id, self.role, _check(result, HANDOFF_RESULTS, "hand-off result")).inc()

    def snapshot(self) -> dict:
        """The current figures as plain data (for a worker's `stats()` and GetClusterStatus)."""
        skip = len(_IDENTITY)

        def value(metric, suffix: str = ""):
            return plain(sample_values(metric, suffix, skip))

        return {
            "worker": self.worker_id,
            "role": self.role,
            "kv_capacity_blocks": value(self._kv_capacity),
            "kv_used_blocks": value(self._kv_used),
            "waiting_requests": value(self._waiting),
            "running_requests": value(self._running),
            "prompt_tokens_total": value(self._prompt, "_total"),
            "prefix_cache_hit_tokens_total": value(self._hits, "_total"),
            "request_queue_time_seconds": histogram_totals(self._queue_s, skip),
            "preemptions_total": value(self._preemptions, "_total"),
            "handoffs_in_flight": value(self._handoffs_in_flight),
            "steps_total": value(self._steps, "_total"),
            "step_tokens_total": value(self._step_tokens, "_total"),
            "step_duration_seconds": histogram_totals(self._step_s, skip),
            "kv_transfer_bytes_total": value(self._transfer_bytes, "_total"),
            "kv_transfer_duration_seconds": histogram_totals(self._transfer_s, skip),
            "handoffs_total": value(self._handoffs, "_total"),
            "prefix_pulls_total": value(self._pulls, "_total"),
            "prefix_pull_blocks_total": value(self._pulled_blocks, "_total"),
            "spec_draft_tokens_total": value(self._spec_drafts, "_total"),
            "spec_accepted_tokens_total": value(self._spec_accepted, "_total"),
            "spec_verify_steps_total": value(self._spec_verify, "_total"),
            "spec_engine_steps_total": value(self._spec_steps, "_total"),
            "moe_expert_tokens_total": value(self._expert_tokens, "_total"),
            "moe_load_imbalance": value(self._load_imbalance),
        }

    # ---- construction -----------------------------------------------------------------------------
    def _gauge(self, name: str, doc: str) -> Gauge:
        gauge = Gauge(name, doc, _IDENTITY, namespace=NAMESPACE, subsystem=SUBSYSTEM, registry=self.registry)
        gauge.labels(self.worker_id, self.role)  # exported (as 0) before the first update
        return gauge

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        counter = Counter(
            name, doc, _IDENTITY + labels, namespace=NAMESPACE, subsystem=SUBSYSTEM, registry=self.registry
        )
        if not labels:
            counter.labels(self.worker_id, self.role)
        return counter

    def _histogram(self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            name,
            doc,
            _IDENTITY + labels,
            namespace=NAMESPACE,
            subsystem=SUBSYSTEM,
            buckets=buckets,
            registry=self.registry,
        )
