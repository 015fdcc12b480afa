"""The router's Prometheus metrics: what an operator of the cluster graphs and alerts on.

Every name starts with `splitserve_router_`; durations are in seconds; counters end in `_total`.
Labels are small fixed sets (never request ids or tenants): `priority` is a class (high > 0,
normal = 0, low < 0), `outcome` a gRPC status name, `reason` one of REJECT_REASONS, and `worker` a
worker id (the cluster's workers are a bounded set).

| metric | type | labels |
|---|---|---|
| splitserve_router_ttft_seconds | histogram | priority |
| splitserve_router_tpot_seconds | histogram | priority |
| splitserve_router_inter_token_latency_seconds | histogram | priority |
| splitserve_router_request_duration_seconds | histogram | priority |
| splitserve_router_requests_total | counter | outcome |
| splitserve_router_goodput_requests_total | counter | |
| splitserve_router_slo_requests_total | counter | slo (ttft, tpot), result (met, missed) |
| splitserve_router_admitted_requests_total | counter | |
| splitserve_router_rejected_requests_total | counter | reason |
| splitserve_router_inflight_requests | gauge | |
| splitserve_router_prompt_tokens_total | counter | |
| splitserve_router_cached_prompt_tokens_total | counter | |
| splitserve_router_generation_tokens_total | counter | |
| splitserve_router_request_prompt_tokens | histogram | |
| splitserve_router_request_generation_tokens | histogram | |
| splitserve_router_migrations_total | counter | cause |
| splitserve_router_worker_{waiting,running}_requests | gauge | worker, role |
| splitserve_router_worker_kv_usage_ratio | gauge | worker, role |
| splitserve_router_worker_healthy | gauge (1/0) | worker, role |
| splitserve_router_worker_epoch | gauge | worker, role |
| splitserve_router_controller_outages_total | counter | |
| splitserve_build_info | gauge (1) | version, python_version, component |

With a `model_name` (what the router serves), every sample also carries `model_name`
(common/metric_identity.py), as vLLM's do.

Goodput counts requests that finished OK within their SLO (TTFT and mean TPOT; a request with no
SLO meets it by finishing). Goodput rate = `rate(splitserve_router_goodput_requests_total[1m])`;
as a share of all requests, divide by `sum(rate(splitserve_router_requests_total[1m]))`. SLO attainment
(`slo_requests_total`) judges each finished request against its effective SLO: its own `ttft_ms` /
`tpot_ms`, else its priority class's default from the admission config; the alert rules' burn rates
read it. The prefix
cache hit rate is `rate(..._cached_prompt_tokens_total[5m]) / rate(..._prompt_tokens_total[5m])`.
Worker restarts = `changes(splitserve_router_worker_epoch[1h])` (each start of a worker has a new
epoch). The per-worker gauges are the router's view (fed by its worker monitor); each worker exports its
own figures too (common/worker_metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metric_identity import ModelRegistry, add_build_info
from common.metrics_http import histogram_totals, plain, sample_values
from router.migration import MigrationCause

NAMESPACE, SUBSYSTEM = "splitserve", "router"
# Interactive TTFT lives in 10 ms – 2 s; a CPU demo or a long queue reaches minutes.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# One decode step per token: ~1–100 ms on a GPU, up to seconds on a loaded CPU.
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
# Per token: a gap between two streamed chunks divided over the chunk's tokens (as vLLM's ITL).
ITL_BUCKETS_S = TPOT_BUCKETS_S
# Prompt and output lengths, 1 token to the longest contexts served (vLLM's 1-2-5 series).
LENGTH_BUCKETS_TOKENS = (*(float(m * 10**e) for e in range(6) for m in (1, 2, 5)), 1e6)
REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
PRIORITY_CLASSES = ("high", "normal", "low")
OUTCOMES = tuple(sorted(code.name.lower() for code in grpc.StatusCode))
UNKNOWN_OUTCOME = "unknown"
SLO_KINDS, SLO_RESULTS = ("ttft", "tpot"), ("met", "missed")
REJECT_REASONS = ("ttft_slo", "tpot_slo", "queue_limit", "kv_capacity", "concurrency", "other")
# Free-text reasons (Overloaded messages) → a label, first match wins; exact label names match first.
_REASON_KEYWORDS = (
    ("ttft_slo", ("ttft", "first token")),
    ("tpot_slo", ("tpot", "per output token")),
    ("queue_limit", ("queue",)),
    ("kv_capacity", ("kv", "block", "memory")),
    ("concurrency", ("concurren", "limit of", "in flight", "inflight")),
)


def priority_class(priority: int) -> str:
    """The `priority` label of a request priority in [-1000, 1000] (three values, not 2001)."""
    return "high" if priority > 0 else "low" if priority < 0 else "normal"


def reject_reason(reason: str) -> str:
    """Maps a rejection's reason (a label name, or an `Overloaded` message) to one of REJECT_REASONS."""
    text = reason.strip().lower()
    if text in REJECT_REASONS:
        return text
    for label, keywords in _REASON_KEYWORDS:
        if any(keyword in text for keyword in keywords):
            return label
    return "other"


def outcome_label(outcome: str) -> str:
    """A gRPC status name in lower case ("ok", "unavailable", ...); anything else is "unknown"."""
    text = outcome.strip().lower()
    return text if text in OUTCOMES else UNKNOWN_OUTCOME


def slo_met(ttft_s: float, tpot_s: float | None, ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> bool:
    """Whether a finished request met its SLO. `tpot_s` is the mean time per output token after the
    first (None when there was only one token); an SLO of None sets no bound."""
    if ttft_slo_ms is not None and ttft_s * 1000.0 > ttft_slo_ms:
        return False
    return tpot_slo_ms is None or tpot_s is None or tpot_s * 1000.0 <= tpot_slo_ms


class RouterMetrics:
    """The router's metrics in a registry of their own (`registry`: serve it with
    common.metrics_http.start_metrics_server). All methods are thread-safe and cheap. With `model_name`,
    the exposition labels every sample with it."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str | None = None):
        if registry is None:
            registry = ModelRegistry(model_name) if model_name is not None else CollectorRegistry()
        self.registry = registry
        add_build_info(self.registry, "router")
        self._ttft = self._histogram(
            "ttft_seconds",
            "Time to first token: from the client's send (its "
            "splitserve-sent-at-us metadata; else arrival at the router) to the "
            "first token leaving the router.",
            ("priority",),
            TTFT_BUCKETS_S,
        )
        self._tpot = self._histogram(
            "tpot_seconds",
            "Mean time per output token after the first, one observation per request.",
            ("priority",),
            TPOT_BUCKETS_S,
        )
        self._itl = self._histogram(
            "inter_token_latency_seconds",
            "Time between two output tokens, one observation per token after the first (a chunk of n "
            "tokens counts its gap from the previous chunk n times, divided by n).",
            ("priority",),
            ITL_BUCKETS_S,
        )
        self._duration = self._histogram(
            "request_duration_seconds",
            "End-to-end time of requests that finished OK.",
            ("priority",),
            REQUEST_BUCKETS_S,
        )
        self._requests = self._counter("requests_total", "Generate calls finished, by gRPC outcome.", ("outcome",))
        self._goodput = self._counter("goodput_requests_total", "Requests finished OK within their SLO.")
        self._slo = self._counter(
            "slo_requests_total",
            "Requests finished OK, by whether they met their effective TTFT or TPOT SLO.",
            ("slo", "result"),
        )
        for kind in SLO_KINDS:  # every series exists from the start: a burn rate is 0, not absent
            for result in SLO_RESULTS:
                self._slo.labels(kind, result)
        self._admitted = self._counter("admitted_requests_total", "Requests admitted by admission control.")
        self._rejected = self._counter("rejected_requests_total", "Requests refused early, by reason.", ("reason",))
        self._migrations = self._counter(
            "migrations_total",
            "Requests moved to other workers after a worker was lost under them, by cause.",
            ("cause",),
        )
        # Every outcome, reason, cause and priority class is exported (as 0) from the start: rates and alerts
        # read 0, not absent, and the first requests show as an increase (a series born at 3 rates as 0).
        for outcome in OUTCOMES:
            self._requests.labels(outcome)
        for histogram in (self._ttft, self._tpot, self._itl, self._duration):
            for priority in PRIORITY_CLASSES:
                histogram.labels(priority)
        for cause in MigrationCause:
            self._migrations.labels(cause.value)
        for reason in REJECT_REASONS:
            self._rejected.labels(reason)
        self._inflight = self._gauge(
            "inflight_requests", "Requests streaming now (incl. aborts not yet confirmed by workers)."
        )
        self._prompt = self._counter("prompt_tokens_total", "Prompt tokens of requests that finished OK.")
        self._cached = self._counter("cached_prompt_tokens_total", "Of those, tokens served from a prefix cache.")
        self._generated = self._counter("generation_tokens_total", "Output tokens of requests that finished OK.")
        self._prompt_len = self._histogram(
            "request_prompt_tokens", "Prompt length of requests that finished OK.", (), LENGTH_BUCKETS_TOKENS
        )
        self._output_len = self._histogram(
            "request_generation_tokens", "Output length of requests that finished OK.", (), LENGTH_BUCKETS_TOKENS
        )
        worker = ("worker", "role")
        self._waiting = self._gauge("worker_waiting_requests", "Requests queued on a worker (last probe).", worker)
        self._running = self._gauge("worker_running_requests", "Requests running on a worker (last probe).", worker)
        self._kv_usage = self._gauge("worker_kv_usage_ratio", "Share of a worker's KV blocks in use (0-1).", worker)
        self._healthy = self._gauge("worker_healthy", "1 if the worker's last probe succeeded, else 0.", worker)
        self._epoch = self._gauge("worker_epoch", "Which start of the worker serves now (1, 2, ...).", worker)
        self._controller_outages = self._counter(
            "controller_outages_total",
            "Times the cluster controller stopped answering this router's membership watch (restarting or gone).",
        )
        self._worker_gauges = (self._waiting, self._running, self._kv_usage, self._healthy, self._epoch)
        # (metric, label value) → labelled child: `labels()` takes a lock and builds a key on every
        # call, over a third of the per-request metrics cost. Filled on first use, so that no series
        # shows up before its first observation.
        self._children: dict[tuple[int, str], object] = {}

    # ---- per request ------------------------------------------------------------------------------
    def observe_ttft(self, seconds: float, priority: int = 0) -> None:
        self._child(self._ttft, priority_class(priority)).observe(seconds)

    def observe_tpot(self, seconds: float, priority: int = 0) -> None:
        """One observation per request: its mean seconds per output token after the first."""
        self._child(self._tpot, priority_class(priority)).observe(seconds)

    def observe_itl(self, gap_s: float, num_tokens: int, priority: int = 0) -> None:
        """A chunk of `num_tokens` output tokens arrived `gap_s` after the previous one: one observation of
        gap_s / num_tokens per token."""
        if num_tokens <= 0:
            return
        child, per_token_s = self._child(self._itl, priority_class(priority)), gap_s / num_tokens
        for _ in range(num_tokens):
            child.observe(per_token_s)

    def observe_request(
        self, outcome: str, met_slo: bool = False, duration_s: float | None = None, priority: int = 0
    ) -> None:
        """Counts a finished Generate call. Goodput and the duration histogram count only "ok" calls."""
        label = outcome_label(outcome)
        self._child(self._requests, label).inc()
        if label != "ok":
            return
        if met_slo:
            self._goodput.inc()
        if duration_s is not None:
            self._child(self._duration, priority_class(priority)).observe(duration_s)

    def observe_slo(self, ttft_s: float, tpot_s: float | None, ttft_slo_ms: float, tpot_slo_ms: float) -> None:
        """A finished request against its effective SLO (TPOT only when it had a second token)."""
        self._slo.labels("ttft", "met" if ttft_s * 1000.0 <= ttft_slo_ms else "missed").inc()
        if tpot_s is not None:
            self._slo.labels("tpot", "met" if tpot_s * 1000.0 <= tpot_slo_ms else "missed").inc()

    def controller_outage(self) -> None:
        """The controller stopped answering (cluster.cluster_view.ClusterView.outage_listeners)."""
        self._controller_outages.inc()

    def admitted(self) -> None:
        self._admitted.inc()

    def rejected(self, reason: str) -> str:
        """Counts an early refusal; `reason` is a label or free text (see `reject_reason`). Returns the label."""
        label = reject_reason(reason)
        self._rejected.labels(label).inc()
        return label

    def migrated(self, cause: str) -> None:
        """A request resumed on other workers; `cause`: prefill_lost, decode_lost, handoff_failed, worker_failed."""
        self._migrations.labels(cause).inc()

    def migrations_by_cause(self) -> dict[str, int]:
        return {cause: int(n) for cause, n in plain(sample_values(self._migrations, "_total")).items() if n}

    def prompt_tokens(self, total: int, cached: int) -> None:
        """A finished request's prompt length and how much of it a prefix cache supplied."""
        if not 0 <= cached <= total:
            raise ValueError(f"cached prompt tokens {cached} not in [0, {total}]")
        self._prompt.inc(total)
        self._cached.inc(cached)
        self._prompt_len.observe(total)

    def generation_tokens(self, count: int) -> None:
        """A finished request's output length (tokens streamed over all its attempts)."""
        if count < 0:
            raise ValueError(f"generation tokens {count} < 0")
        self._generated.inc(count)
        self._output_len.observe(count)

    # ---- state ------------------------------------------------------------------------------------
    def set_inflight(self, n: int) -> None:
        self._inflight.set(n)

    def track_inflight(self, read: Callable[[], float]) -> None:
        """Reads the in-flight count at each scrape instead (from the exporter's thread: `read` must
        be safe to call there, e.g. `lambda: service.inflight_requests`)."""
        self._inflight.set_function(read)

    def set_worker_load(
        self,
        worker_id: str,
        role: str,
        waiting: int,
        running: int,
        kv_usage: float,
        healthy: bool = True,
        epoch: int | None = None,
    ) -> None:
        """The router's latest probe of one worker (WorkerMonitor.stats and is_healthy), and which start
        of it that was (`epoch`, from membership)."""
        self._waiting.labels(worker_id, role).set(waiting)
        self._running.labels(worker_id, role).set(running)
        self._kv_usage.labels(worker_id, role).set(kv_usage)
        self._healthy.labels(worker_id, role).set(1 if healthy else 0)
        if epoch is not None:
            self._epoch.labels(worker_id, role).set(epoch)

    def forget_worker(self, worker_id: str, role: str) -> None:
        """Drops a worker's series (it left the cluster), so dashboards do not show a stale last value."""
        for gauge in self._worker_gauges:
            gauge.remove(worker_id, role)

    def requests_by_outcome(self) -> dict[str, int]:
        """Finished requests by outcome, outcomes that occurred only (GetClusterStatus.requests_total)."""
        return {
            outcome: int(count) for outcome, count in plain(sample_values(self._requests, "_total")).items() if count
        }

    def snapshot(self) -> dict:
        """The current figures as plain data (what GetClusterStatus shows): counters by label value,
        histograms as {"count", "sum"} per priority class, workers by id."""
        workers: dict[str, dict] = {}
        for gauge, name in (
            (self._waiting, "waiting"),
            (self._running, "running"),
            (self._kv_usage, "kv_usage"),
            (self._healthy, "healthy"),
        ):
            for (worker_id, role), value in sample_values(gauge).items():
                workers.setdefault(worker_id, {"role": role})[name] = value
        return {
            "requests_total": self.requests_by_outcome(),
            "goodput_requests_total": plain(sample_values(self._goodput, "_total")),
            "admitted_requests_total": plain(sample_values(self._admitted, "_total")),
            "rejected_requests_total": plain(sample_values(self._rejected, "_total")),
            "migrations_total": plain(sample_values(self._migrations, "_total")),
            "inflight_requests": plain(sample_values(self._inflight)),
            "prompt_tokens_total": plain(sample_values(self._prompt, "_total")),
            "cached_prompt_tokens_total": plain(sample_values(self._cached, "_total")),
            "generation_tokens_total": plain(sample_values(self._generated, "_total")),
            "ttft_seconds": _observed(histogram_totals(self._ttft)),
            "tpot_seconds": _observed(histogram_totals(self._tpot)),
            "inter_token_latency_seconds": _observed(histogram_totals(self._itl)),
            "request_duration_seconds": _observed(histogram_totals(self._duration)),
            "workers": workers,
        }

    def _child(self, metric, label: str):
        """`metric.labels(label)`, cached (thread-safe: `labels` hands racing callers the same child)."""
        key = (id(metric), label)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(label)
        return child

    # ---- construction -----------------------------------------------------------------------------
    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, labels, namespace=NAMESPACE, subsystem=SUBSYSTEM, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, namespace=NAMESPACE, subsystem=SUBSYSTEM, registry=self.registry)

    def _histogram(self, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> Histogram:
        return Histogram(
            name, doc, labels, namespace=NAMESPACE, subsystem=SUBSYSTEM, buckets=buckets, registry=self.registry
        )


def _observed(totals: dict) -> dict:
    """Per-priority histogram totals, the classes with observations only."""
    return {label: figures for label, figures in totals.items() if figures["count"]}
