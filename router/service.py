"""The router's domain logic: admit, hash, route, stream (docs/architecture.md, "Request lifecycle", steps 0, 1 and 6).

`RouterService.generate` takes a validated `RouterRequest` and yields `RouterOutput`s. It knows
nothing of gRPC: the servicer translates proto ↔ these types and the error interceptor turns the
exceptions raised here (`InvalidRequestError`, `RequestFailed`, `Overloaded`, `DuplicateRequest`,
`NoWorkersError`) into status codes. The outputs and the router's own refusals are defined in
router/service_types.py; choosing the workers of a route, in router/worker_choice.py; what a lost worker
means for a request, in router/migration.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator

from cluster.client import ClusterClient, RequestFailed
from cluster.cluster_view import ClusterView
from common import logs, tracing
from common.membership import ROLES, Membership
from common.messages import GenerateRequest
from engine.block_hash import check_spec_fingerprint
from engine.errors import InvalidRequestError
from policies.admission.gate import AdmissionGate
from policies.host_fetch_cost import HostFetchCost, host_read_prior
from policies.prefix_pull import PullPlanner
from policies.routing import RoutingPolicy
from policies.store_fetch_cost import StoreFetchCost
from router.ledger import RouteLedger
from router.metrics import RouterMetrics, slo_met
from router.migration import cause_of
from router.request_keys import route_query, timed
from router.service_types import DuplicateRequest, Overloaded, RouteInfo, RouterOutput
from router.stream_state import StreamState
from router.traffic_reporter import TrafficReporter
from router.validation import ModelLimits, RouterRequest
from router.worker_choice import WorkerChooser
from router.worker_monitor import WorkerMonitor

log = logging.getLogger(__name__)


class RouterService:
    """`cluster` is the router's live ClusterView: every request routes over the members serving now."""

    def __init__(
        self,
        cluster: ClusterView,
        policy: RoutingPolicy,
        *,
        tokenizer=None,
        max_concurrent_requests: int = 1024,
        monitor: WorkerMonitor | None = None,
        index=None,
        metrics: RouterMetrics | None = None,
        admission: AdmissionGate | None = None,
    ):
        self.cluster, self.policy, self.tokenizer, self.index = cluster, policy, tokenizer, index
        self.info = cluster.prefill[0].info
        self._pool_blocks: dict[str, int] = {}  # role → the smallest KV pool of its last known members
        self._check_members(cluster.membership, cluster.membership)
        cluster.listeners.append(self._check_members)
        self.limits = ModelLimits(self.info.vocab_size, self.info.max_model_len, tokenizer is not None)
        self.max_concurrent_requests = max_concurrent_requests
        self.client = ClusterClient(cluster)
        self.metrics = metrics or RouterMetrics()
        self.monitor = monitor or WorkerMonitor(cluster, self.metrics)
        self.admission = admission
        if admission is not None:
            self.monitor.listeners.append(admission.observe_stats)
            self.client.handoff_listeners.append(admission.observe_handoff)
        # With admission on, the planner reads the gate's prefill model (fitted once, from the same steps).
        self.pull_planner = PullPlanner(
            cluster.config.router.prefix_pull,
            self.info.kv_bytes_per_token,
            admission.prefill_cost if admission is not None else None,
        )
        if admission is None:
            self.monitor.listeners.append(self.pull_planner.observe_stats)
        self.client.handoff_listeners.append(
            lambda stats: self.pull_planner.observe_transfer(stats.num_bytes, stats.elapsed_s)
        )
        # With a shared KV store, cache_aware prices fetching from it against recomputing, by the workers'
        # measured fetch bandwidth and the planner's prefill model.
        self.store_location = StoreFetchCost.from_config(
            cluster.config.kv_store, self.info.kv_bytes_per_token * self.info.block_size, self.pull_planner.prefill_cost
        )
        if self.store_location is not None:
            policy.locate_store(self.store_location)
            self.monitor.listeners.append(self.store_location.observe_stats)
        # With host tiers, it prices a worker fetching back what its pool evicted, by that worker's own
        # measured host-tier bandwidth (the index says which worker's host tier holds what).
        self.host_location: HostFetchCost | None = None
        if cluster.config.kv_store.host_tier_bytes > 0:
            self.host_location = HostFetchCost(
                self.info.kv_bytes_per_token * self.info.block_size,
                self.pull_planner.prefill_cost,
                host_read_prior(cluster.config.kv_store),
            )
            policy.locate_host_tier(self.host_location)
            self.monitor.listeners.append(self.host_location.observe_stats)
        # admitted request → uncached tokens queued on its prefill worker at admission, its own included
        self._tokens_through: dict[str, int] = {}
        self._running: set[str] = set()
        self.ledger, self.traffic = RouteLedger(), TrafficReporter(cluster.controller, cluster.config.planner)
        self.chooser = WorkerChooser(cluster, policy, self.monitor, self.ledger, self.client)

    def _check_members(self, old: Membership, new: Membership) -> None:
        """Membership listener: every worker must hash blocks by this router's spec and serve its model
        (the controller starts them all from one config; this catches a mixed deployment loudly)."""
        for member in new.members:
            check_spec_fingerprint(member.info.hash_spec)
            if member.info.model_identity != self.info.model_identity:
                raise RuntimeError(
                    f"worker {member.worker_id} serves {member.info.model_identity}, this router "
                    f"{self.info.model_identity}"
                )
        for role in ROLES:
            sizes = [m.info.num_blocks for m in new.members if m.role == role]
            if sizes:  # a pool with no member now (every worker dead, replacements starting) keeps its size
                self._pool_blocks[role] = min(sizes)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    @property
    def inflight_requests(self) -> int:
        """Requests streaming, plus cancelled ones whose workers have not confirmed the abort yet."""
        return len(self._running) + self.client.num_cleanups

    async def generate(
        self, request: RouterRequest, deadline_s: float | None = None, waited_s: float = 0.0
    ) -> AsyncGenerator[RouterOutput, None]:
        """Streams one request (deadline_s: time.monotonic; waited_s: how long ago its client sent it, as
        far as the router can tell). Raises the exceptions named above. TTFT counts from the client's send."""
        started_s = time.perf_counter() - waited_s
        logs.set_request_id(request.request_id)
        # Not the current span across the yields below: each span names its parent (tracing's docstring).
        root = tracing.start(
            "splitserve.request",
            kind="server",
            request_id=request.request_id,
            prompt_tokens=len(request.prompt_token_ids),
            priority=request.priority,
        )
        trace = tracing.context_of(root, request.request_id)
        state, error = None, None
        try:
            self._admit(request)
            self.traffic.arrived(len(request.prompt_token_ids))
            self._running.add(request.request_id)
            state = StreamState(request, self.tokenizer, started_s, self.cluster.config.router.migration_limit)
            async for output in self._run(request, deadline_s, state, waited_s, trace):
                yield output
        except BaseException as err:
            error = type(err).__name__
            raise
        finally:
            self._running.discard(request.request_id)
            if root is not None:
                migrations = state.migrations.total if state is not None else 0
                tracing.end(root, error, output_tokens=state.num_tokens if state else 0, migrations=migrations)

    async def _run(
        self,
        request: RouterRequest,
        deadline_s: float | None,
        state: StreamState,
        waited_s: float,
        trace: tracing.TraceContext | None = None,
    ) -> AsyncGenerator[RouterOutput, None]:
        """Attempts until the request ends: a worker lost under an attempt migrates the request to others
        (router/migration.py decides whether, and counts); any other failure ends it."""
        while not state.finished:
            attempt = tracing.start(
                "splitserve.attempt", trace, attempt=state.migrations.total, resumed_tokens=state.num_tokens
            )
            error = None
            try:
                async for output in self._attempt(request, deadline_s, state, waited_s, attempt):
                    yield output
            except BaseException as err:
                error = type(err).__name__
                raise
            finally:
                tracing.end(attempt, error if error is not None or state.finished else "migrated")

    async def _attempt(
        self, request: RouterRequest, deadline_s: float | None, state: StreamState, waited_s: float, span=None
    ) -> AsyncGenerator[RouterOutput, None]:
        """One route of the request: from its prompt and the tokens streamed so far, to its end, or to the
        loss of a worker the request migrates after (returns); other failures raise."""
        resumed = tuple(state.token_ids)
        query = route_query(
            request.prompt_token_ids + resumed, request.tenant, self.info.model_identity, self.info.block_size
        )
        trace = tracing.context_of(span, request.request_id)
        with tracing.span("splitserve.route", trace, policy=self.policy.name) as route_span:
            prefill, decode, decision = await self.chooser.choose(query, deadline_s)
            if route_span is not None:
                tracing.annotate(route_span, prefill_worker=prefill.worker_id, decode_worker=decode.worker_id)
        worker_id = prefill.worker_id
        log.debug(
            "routing %s to %s and %s (attempt %d)",
            request.request_id,
            worker_id,
            decode.worker_id,
            state.migrations.total,
        )
        healthy = self.chooser.loads.prefill.ids  # the routable prefill workers (kept, not listed per request)
        # Prompt logprobs need every prompt position computed: no cache hit is read, so none is pulled.
        scores_prompt = request.params.prompt_logprobs is not None and not resumed
        pull = None if scores_prompt else self.pull_planner.plan(query, decision, healthy)
        expected_blocks = (
            0 if scores_prompt else pull.num_blocks if pull is not None else decision.expected_cached_blocks
        )
        if state.migrations.total == 0:  # admitted once: a migration is never refused
            with tracing.span("splitserve.admission", trace):
                self._admission_check(request, expected_blocks * query.block_size, worker_id, decode, waited_s)
        uncached = max(query.num_prompt_tokens - expected_blocks * query.block_size, 1)
        self.ledger.book(request.request_id, worker_id, decode.worker_id, uncached, state)
        cluster_s, first = [0.0], True
        try:
            # Each attempt has an id of its own on the workers: the cleanup of a failed attempt (abort, cancel)
            # must never reach the next attempt of the same request, nor a client's retry of it.
            cluster_request = GenerateRequest(
                state.attempt_id,
                request.prompt_token_ids,
                request.params,
                request.priority,
                request.tenant,
                pull,
                output_token_ids=resumed,
                trace_context=trace,
            )
            async for chunk in timed(self.client.generate(cluster_request, prefill, decode, deadline_s), cluster_s):
                if first:
                    self.ledger.first_token(worker_id, uncached)
                    if chunk.pull is not None:
                        self.pull_planner.observe_pull(chunk.pull)
                route = (
                    None
                    if state.started
                    else RouteInfo(worker_id, decode.worker_id, self.policy.name, chunk.num_cached_tokens)
                )
                first = False
                scored = chunk.prompt_logprobs
                previous_s = state.last_token_s
                delta, usage = state.add(chunk)
                if previous_s is not None and state.last_token_s is not None:
                    self.metrics.observe_itl(state.last_token_s - previous_s, len(chunk.token_ids), request.priority)
                last = chunk.finish_reason is not None
                yield RouterOutput(
                    request.request_id,
                    chunk.token_ids,
                    delta,
                    chunk.logprobs,
                    chunk.finish_reason,
                    route,
                    usage,
                    state.migrations.total if last else 0,
                    state.upstream_s + cluster_s[0] if last else None,
                    None if scored is None else tuple(zip(request.prompt_token_ids[1:], scored, strict=True)),
                )
            self._finished(state)
        except RequestFailed as err:
            if err.lost_worker is not None:  # known dead: no request routes to it again
                self.monitor.mark_dead(*err.lost_worker)
            state.migrations.migrate(err)  # raises when the request must fail instead
            self.monitor.probe_soon()
            cause = cause_of(err, prefill, decode)
            self.metrics.migrated(cause)
            tracing.event(span, "migrate", cause=str(cause), reason=err.reason, streamed_tokens=state.num_tokens)
            log.info("migrating %s after %d token(s): %s", request.request_id, state.num_tokens, err.reason)
        finally:
            state.upstream_s += cluster_s[0]
            self.ledger.release(request.request_id, worker_id, decode.worker_id, uncached if first else 0)
            tokens_through = self._tokens_through.pop(request.request_id, None)
            if tokens_through is not None and self.admission is not None and state.ttft_s is not None:  # started
                # From the router's arrival: the wait before it is the request's own, not the worker's.
                self.admission.observe_ttft(tokens_through, state.ttft_s - waited_s)

    def _admission_check(
        self, request: RouterRequest, cached_tokens: int, worker_id: str, decode, waited_s: float
    ) -> None:
        """Admit, or reject early (before any worker is touched) with the policy's reason."""
        if self.admission is None:
            return
        running = self.ledger.running_on(decode.worker_id)
        load = self.ledger.prefill_load(worker_id)
        total = decode.info.num_blocks
        stats = self.monitor.stats.get(decode.worker_id)  # up to a probe interval old: the gate corrects it
        reported_free = stats.num_free_blocks if stats is not None else total
        verdict = self.admission.decide(
            request, cached_tokens, load, decode.worker_id, running, reported_free, total, waited_s
        )
        if not verdict.admit:
            self.metrics.rejected(str(verdict.cause))
            raise Overloaded(verdict.reason, verdict.retry_after_s)
        self.metrics.admitted()
        # The same uncached count `_run` queues; every admitted request is a sample, whatever the policy.
        uncached = max(len(request.prompt_token_ids) - cached_tokens, 1)
        self._tokens_through[request.request_id] = load.queued_prompt_tokens + uncached

    def _finished(self, state: StreamState) -> None:
        request, metrics = state.request, self.metrics
        ttft_s = state.ttft_s
        assert ttft_s is not None, "a finished stream has its first token"
        metrics.observe_ttft(ttft_s, request.priority)
        if state.tpot_s is not None:
            metrics.observe_tpot(state.tpot_s, request.priority)
        met = slo_met(ttft_s, state.tpot_s, request.ttft_ms, request.tpot_ms)
        metrics.observe_request("ok", met_slo=met, duration_s=state.duration_s, priority=request.priority)
        metrics.prompt_tokens(len(request.prompt_token_ids), state.cached_tokens)
        metrics.generation_tokens(state.num_tokens)
        logs.count_tokens(len(request.prompt_token_ids), state.num_tokens)
        default = self.cluster.config.admission.slo_for(request.priority)
        metrics.observe_slo(
            ttft_s,
            state.tpot_s,
            request.ttft_ms if request.ttft_ms is not None else default.ttft_ms,
            request.tpot_ms if request.tpot_ms is not None else default.tpot_ms,
        )
        self.traffic.finished(state.num_tokens, ttft_s, state.tpot_s)

    def _admit(self, request: RouterRequest) -> None:
        if request.request_id in self._running:
            raise DuplicateRequest(f"request_id {request.request_id!r} is already running")
        if len(self._running) >= self.max_concurrent_requests:
            raise Overloaded(
                f"the router is serving its limit of {self.max_concurrent_requests} requests", retry_after_s=1.0
            )
        blocks_needed = -(-(len(request.prompt_token_ids) + 1) // self.info.block_size)
        smallest_pool_blocks = min(self._pool_blocks.values())
        if blocks_needed > smallest_pool_blocks:
            field = "text" if request.prompt_text is not None else "token_ids"
            raise InvalidRequestError(
                field, f"prompt needs {blocks_needed} KV blocks; the smallest worker pool has {smallest_pool_blocks}"
            )

    def worker_loads(self) -> dict[str, int]:
        """Requests this router has in flight on each member (draining ones included)."""
        return {
            m.worker_id: (
                self.ledger.inflight(m.worker_id) if m.role == "prefill" else self.client.decode_load(m.worker_id)
            )
            for m in self.cluster.members
        }

    async def index_entries(self) -> int:
        """Block hashes the prefix index holds over all workers (0 without an index)."""
        return 0 if self.index is None else await self.index.num_entries()

    async def close(self) -> None:
        await self.client.close()
        if self.store_location is not None:
            self.store_location.close()
