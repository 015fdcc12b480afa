"""The router's domain logic: admit, hash, route, stream (DESIGN.md lifecycle steps 2–3, 6).

`RouterService.generate` takes a validated `RouterRequest` and yields `RouterOutput`s. It knows
nothing of gRPC: the servicer translates proto ↔ these types and the error interceptor turns the
exceptions raised here (`InvalidRequestError`, `RequestFailed`, `Overloaded`, `DuplicateRequest`,
`NoWorkersError`) into status codes.
"""
from __future__ import annotations

import array
import sys
import time
from collections import Counter, defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cluster.client import ClusterClient, RequestFailed
from cluster.cluster_view import ClusterView
from cluster.membership import Membership
from cluster.messages import GenerateRequest, PrefixPull
from engine.block_hash import HashNamespace, check_spec_fingerprint, hash_blocks
from engine.errors import InvalidRequestError
from router.routing import NoWorkersError, RouteQuery, RoutingPolicy, WorkerLoad
from router.admission import RunningRequest
from router.admission_gate import AdmissionGate
from router.metrics import RouterMetrics, slo_met
from router.prefix_pull_planner import PullPlanner
from router.stream_state import StreamState, Usage
from router.validation import ModelLimits, RouterRequest
from router.worker_monitor import WorkerMonitor


class Overloaded(RuntimeError):
    """The router refuses new work now; `retry_after_s` suggests when to try again."""

    def __init__(self, reason: str, retry_after_s: float | None):
        super().__init__(reason)
        self.reason, self.retry_after_s = reason, retry_after_s


class DuplicateRequest(RuntimeError):
    """A request with the same request_id is still running."""


@dataclass(frozen=True)
class RouteInfo:
    prefill_worker: str
    decode_instance: str
    policy: str
    cached_prompt_tokens: int


@dataclass(frozen=True)
class RouterOutput:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple  # engine.sampler.TokenLogprobs per token, when requested
    finish_reason: str | None
    route: RouteInfo | None = None
    usage: Usage | None = None


class RouterService:
    """`cluster` is the router's live ClusterView: every request routes over the members serving now."""

    def __init__(self, cluster: ClusterView, policy: RoutingPolicy, *, tokenizer=None,
                 max_concurrent_requests: int = 1024, monitor: WorkerMonitor | None = None, index=None,
                 metrics: RouterMetrics | None = None, admission: AdmissionGate | None = None):
        self.cluster, self.policy, self.tokenizer, self.index = cluster, policy, tokenizer, index
        self.info = cluster.prefill[0].info
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
        self.pull_planner = PullPlanner(cluster.config.router.prefix_pull, self.info.kv_bytes_per_token,
                                        admission.prefill_cost if admission is not None else None)
        if admission is None:
            self.monitor.listeners.append(self.pull_planner.observe_stats)
        self.client.handoff_listeners.append(lambda stats: self.pull_planner.observe_transfer(stats.num_bytes,
                                                                                              stats.elapsed_s))
        self._decoding: dict[str, dict[str, StreamState]] = defaultdict(dict)  # decode worker → its streams
        # admitted request → uncached tokens queued on its prefill worker at admission, its own included
        self._tokens_through: dict[str, int] = {}
        self._running: set[str] = set()
        self._queued_tokens = Counter()  # prefill worker → uncached prompt tokens awaiting their first token
        self._inflight = Counter()  # prefill worker → requests in flight
        # (request id, seconds spent inside the cluster API) of recent requests: benchmarks subtract it
        # from what the client saw to get what the router path added to that very request.
        self.cluster_call_s: deque[tuple[str, float]] = deque(maxlen=100_000)

    def _check_members(self, old: Membership, new: Membership) -> None:
        """Membership listener: every worker must hash blocks by this router's spec and serve its model
        (the controller starts them all from one config; this catches a mixed deployment loudly)."""
        for member in new.members:
            check_spec_fingerprint(member.info.hash_spec)
            if member.info.model_identity != self.info.model_identity:
                raise RuntimeError(f"worker {member.worker_id} serves {member.info.model_identity}, this router "
                                   f"{self.info.model_identity}")
        self._min_pool_blocks = min((m.info.num_blocks for m in new.members), default=0)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    @property
    def inflight_requests(self) -> int:
        """Requests streaming, plus cancelled ones whose workers have not confirmed the abort yet."""
        return len(self._running) + self.client.num_cleanups

    async def generate(self, request: RouterRequest, deadline_s: float | None = None,
                       waited_s: float = 0.0) -> AsyncIterator[RouterOutput]:
        """Streams one request (deadline_s: time.monotonic; waited_s: how long ago its client sent it, as
        far as the router can tell). Raises the exceptions named above. TTFT counts from the client's send."""
        started_s = time.perf_counter() - waited_s
        self._admit(request)
        self._running.add(request.request_id)
        try:
            async for output in self._run(request, deadline_s, StreamState(request, self.tokenizer, started_s),
                                          waited_s):
                yield output
        finally:
            self._running.discard(request.request_id)

    async def _run(self, request: RouterRequest, deadline_s: float | None, state: StreamState,
                   waited_s: float) -> AsyncIterator[RouterOutput]:
        query = self._route_query(request)
        prefill, decode, decision = await self._choose(query)
        worker_id = prefill.worker_id
        healthy = [h.worker_id for h in self.cluster.prefill if self.monitor.is_healthy(h.worker_id)]
        pull = self.pull_planner.plan(query, decision, healthy)
        expected_blocks = pull.num_blocks if pull is not None else decision.expected_cached_blocks
        self._admission_check(request, expected_blocks * query.block_size, worker_id, decode, waited_s)
        uncached = max(query.num_prompt_tokens - expected_blocks * query.block_size, 1)
        self._decoding[decode.worker_id][request.request_id] = state
        self._inflight[worker_id] += 1
        self._queued_tokens[worker_id] += uncached
        cluster_s = [0.0]
        try:
            chunks = _timed(self.client.generate(self._cluster_request(request, pull), prefill, decode,
                                                 deadline_s), cluster_s)
            async for chunk in chunks:
                route = None
                if not state.started:
                    self._queued_tokens[worker_id] -= uncached
                    if chunk.pull is not None:
                        self.pull_planner.observe_pull(chunk.pull)
                    route = RouteInfo(worker_id, decode.worker_id, self.policy.name, chunk.num_cached_tokens)
                delta, usage = state.add(chunk)
                yield RouterOutput(request.request_id, chunk.token_ids, delta, chunk.logprobs,
                                   chunk.finish_reason, route, usage)
            self._finished(state, cluster_s[0])
        except RequestFailed as err:
            if err.unavailable:  # re-probe now so that the next requests avoid a dead worker at once
                self.monitor.probe_soon()
            raise
        finally:
            if not state.started:
                self._queued_tokens[worker_id] -= uncached
            self._inflight[worker_id] -= 1
            streams = self._decoding[decode.worker_id]
            streams.pop(request.request_id, None)
            if not streams:
                del self._decoding[decode.worker_id]
            tokens_through = self._tokens_through.pop(request.request_id, None)
            if tokens_through is not None and state.started:
                # From the router's arrival: the wait before it is the request's own, not the worker's.
                self.admission.observe_ttft(tokens_through, state.ttft_s - waited_s)

    def _admission_check(self, request: RouterRequest, cached_tokens: int, worker_id: str, decode,
                         waited_s: float) -> None:
        """Admit, or reject early (before any worker is touched) with the policy's reason."""
        if self.admission is None:
            return
        running = [RunningRequest(s.num_tokens, s.request.params.max_tokens,
                                  len(s.request.prompt_token_ids) + s.num_tokens)
                   for s in self._decoding.get(decode.worker_id, {}).values()]
        load = WorkerLoad(worker_id, self._inflight[worker_id], self._queued_tokens[worker_id])
        total = decode.info.num_blocks
        # The monitor's figure is up to a probe interval old; what this router reserved since is exact.
        held = sum(-(-(r.context_tokens + 1) // self.info.block_size) for r in running)
        stats = self.monitor.stats.get(decode.worker_id)
        free = min(stats.num_free_blocks if stats is not None else total, total - held)
        verdict = self.admission.decide(request, cached_tokens, load, decode.worker_id, running,
                                        max(free, 0), total, waited_s)
        if not verdict.admit:
            self.metrics.rejected(str(verdict.cause))
            raise Overloaded(verdict.reason, verdict.retry_after_s)
        self.metrics.admitted()
        # The same uncached count `_run` queues; every admitted request is a sample, whatever the policy.
        uncached = max(len(request.prompt_token_ids) - cached_tokens, 1)
        self._tokens_through[request.request_id] = self._queued_tokens[worker_id] + uncached

    def _finished(self, state: StreamState, cluster_s: float) -> None:
        request = state.request
        self.cluster_call_s.append((request.request_id, cluster_s))
        metrics = self.metrics
        metrics.observe_ttft(state.ttft_s, request.priority)
        if state.tpot_s is not None:
            metrics.observe_tpot(state.tpot_s, request.priority)
        met = slo_met(state.ttft_s, state.tpot_s, request.ttft_ms, request.tpot_ms)
        metrics.observe_request("ok", met_slo=met, duration_s=state.duration_s, priority=request.priority)
        metrics.prompt_tokens(len(request.prompt_token_ids), state.cached_tokens)

    def _admit(self, request: RouterRequest) -> None:
        if request.request_id in self._running or self.client.is_active(request.request_id):
            raise DuplicateRequest(f"request_id {request.request_id!r} is already running")
        if len(self._running) >= self.max_concurrent_requests:
            raise Overloaded(f"the router is serving its limit of {self.max_concurrent_requests} requests",
                             retry_after_s=1.0)
        blocks_needed = -(-(len(request.prompt_token_ids) + 1) // self.info.block_size)
        if blocks_needed > self._min_pool_blocks:
            field = "text" if request.prompt_text is not None else "token_ids"
            raise InvalidRequestError(field, f"prompt needs {blocks_needed} KV blocks; the smallest worker pool "
                                             f"has {self._min_pool_blocks}")

    def _route_query(self, request: RouterRequest) -> RouteQuery:
        namespace = HashNamespace(self.info.model_identity, self.info.block_size, request.tenant)
        tokens = request.prompt_token_ids
        hashes = tuple(hash_blocks(namespace, tokens))
        key = b"" if hashes else _le_uint32(tokens) + request.tenant.encode()  # keys only block-less prompts
        return RouteQuery(hashes, len(tokens), self.info.block_size, key)

    async def _choose(self, query: RouteQuery):
        healthy = [h for h in self.cluster.prefill if self.monitor.is_healthy(h.worker_id)]
        if not healthy:
            raise NoWorkersError("no healthy prefill worker to route to")
        loads = [WorkerLoad(h.worker_id, self._inflight[h.worker_id], self._queued_tokens[h.worker_id])
                 for h in healthy]
        decision = await self.policy.choose(query, loads)
        prefill = next(h for h in healthy if h.worker_id == decision.worker_id)
        decodes = [d for d in self.cluster.decode if self.monitor.is_healthy(d.worker_id)]
        if not decodes:
            raise NoWorkersError("no healthy decode instance to route to")
        decode = min(decodes, key=lambda d: (self.client.decode_load(d.worker_id), d.worker_id))
        return prefill, decode, decision

    @staticmethod
    def _cluster_request(request: RouterRequest, pull: PrefixPull | None) -> GenerateRequest:
        return GenerateRequest(request.request_id, request.prompt_token_ids, request.params, request.priority,
                               request.tenant, pull)

    def worker_loads(self) -> dict[str, int]:
        """Requests this router has in flight on each member (draining ones included)."""
        return {m.worker_id: (self._inflight[m.worker_id] if m.role == "prefill"
                              else self.client.decode_load(m.worker_id)) for m in self.cluster.members}

    async def index_entries(self) -> int:
        """Block hashes the prefix index holds over all workers (0 without an index)."""
        return 0 if self.index is None else await self.index.num_entries()

    async def close(self) -> None:
        await self.client.close()


def _le_uint32(tokens) -> bytes:
    """Token ids as little-endian uint32 bytes, built in C (a Python join costs ~10x more)."""
    packed = array.array("I", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


async def _timed(chunks: AsyncIterator, spent_s: list[float]) -> AsyncIterator:
    """Passes `chunks` through, adding the time spent waiting on it to spent_s[0]."""
    iterator = chunks.__aiter__()
    try:
        while True:
            started_s = time.perf_counter()
            try:
                chunk = await iterator.__anext__()
            except StopAsyncIteration:
                return
            finally:
                spent_s[0] += time.perf_counter() - started_s
            yield chunk
    finally:
        await iterator.aclose()  # leaving early must still run the cluster client's cleanup


def deadline_from_remaining(time_remaining_s: float | None) -> float | None:
    return None if time_remaining_s is None else time.monotonic() + time_remaining_s
