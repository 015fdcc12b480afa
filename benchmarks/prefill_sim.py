"""A discrete-event replay of prompts through N prefill workers, routed by a real policy.

What is real: the routing policy (`policies.routing.make_policy`), the router's load bookkeeping (the
same WorkerLoad figures `router/service.py` keeps), each worker's `KVCacheManager` over a finite
`BlockPool` (prefix lookup with token verification, allocation, LRU eviction), the `BlockStored` /
`BlockRemoved` events it emits into a real `KVEventBuffer`, the `IndexFeeder` that pulls those
buffers in batches into a real `InProcessPrefixIndex` (apply + heartbeat, leases on the simulated
clock), and the block hashes the requests carry (the caller makes them with `hash_blocks`).
What is modelled: compute time only. A worker prefills one request at a time, first come first
served, and takes `uncached prompt tokens / prefill_tokens_per_s` seconds for it; no model runs.

A request's life, as in the cluster:
1. arrival: the policy picks a worker from the live loads; the router adds its estimate of the
   uncached tokens (prompt minus the prefix the policy expects cached) to that worker's queue;
2. it waits in the worker's FIFO queue;
3. start: the engine looks up its cached prefix and allocates its blocks (the hit is counted here,
   as the engine reports `num_cached_tokens`);
4. done after the modelled compute: its full blocks are cached (events emitted), then released,
   so they stay cached until LRU eviction; the router removes its estimate from the queue;
5. every `feed_interval_s` the feeder applies each worker's new events to the index.
With `prefix_pull` on, the real `PullPlanner` decides at arrival (1) whether the chosen worker pulls
the prefix the index shows on a better holder; the pull copies the blocks the holder still holds into
the chosen worker's real pool (cached, pinned until the request starts) and takes a modelled transfer
time, which delays the request's start if it has not waited that long anyway.
Time never reads a wall clock, so a replay is deterministic; only `match` latencies are wall-timed.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from benchmarks.prefill_sim_worker import SimWorker
from common.kv_events import KVEventBuffer
from common.messages import PullOutcome
from engine.block_hash import BlockHash
from policies.admission import PrefillStep
from policies.routing import CacheAwarePolicy, PrefixHashPolicy, RouteQuery, RoutingPolicy, make_policy
from prefix_index.memory import InProcessPrefixIndex
from router.index_feeder import IndexFeeder
from router.prefix_pull_planner import PullPlanner

# Kinds order events due at the same instant: a finishing prefill frees its worker and a feed
# refreshes the index before an arrival at that instant is routed.
_DONE, _FEED, _ARRIVE = 0, 1, 2

# The policies that key a consistent-hash ring on the prompt's leading blocks, given that ring.
_RING_POLICIES = {
    "prefix_hash": lambda index, ring: ring,
    "cache_aware": lambda index, ring: CacheAwarePolicy(index, fallback=ring),
}


def build_policy(name: str, index, prefix_blocks: int | None = None) -> RoutingPolicy:
    """The registry's policy (`make_policy`), as the router builds it. `prefix_blocks` re-keys the ring
    of prefix_hash (and cache_aware's tie-break and fallback) on that many leading blocks: a knob the
    real classes take but the cluster config does not expose yet."""
    if prefix_blocks is None or name not in _RING_POLICIES:
        return make_policy(name, index)
    return _RING_POLICIES[name](index, PrefixHashPolicy(prefix_blocks=prefix_blocks))


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    token_ids: np.ndarray  # compact storage; expanded to a list only while a worker holds the request
    block_hashes: tuple[BlockHash, ...]  # hash_blocks(...) of token_ids: full blocks only

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SimConfig:
    num_workers: int = 4
    blocks_per_worker: int = 16_384  # 262k tokens of 16: see bench_prefix_routing on sizing
    block_size: int = 16
    prefill_tokens_per_s: float = 20_000.0  # modelled compute rate of one worker
    feed_interval_s: float = 0.05  # ClusterConfig's router.index_poll_interval_s default
    index_lease_s: float = 30.0  # ClusterConfig's index_lease_s default
    # Prefix pulls between workers (router/prefix_pull_planner.py modes), and the modelled KV transfer
    # (pulls and hand-offs): demo-model KV (24,576 bytes per token) at 2.5 GB/s after 5 ms: a link in
    # proportion to the modelled 20k tokens/s of prefill (the 2-core CPU box is slower at both).
    prefix_pull: str = "never"
    kv_bytes_per_token: int = 24_576
    pull_latency_s: float = 0.005
    pull_bytes_per_s: float = 2.5e9

    def __post_init__(self):
        for name in ("num_workers", "blocks_per_worker", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_tokens_per_s", "feed_interval_s", "index_lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.index_lease_s <= self.feed_interval_s:
            raise ValueError("index_lease_s must exceed feed_interval_s, or every worker would expire")

    def worker_ids(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.num_workers)]


@dataclass
class ReplayResult:
    policy: str
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # found by the worker's prefix lookup when its prefill started (pulled included)
    pulled_tokens: int = 0  # of those, pulled from a peer's cache at arrival
    queue_delay_total_s: float = 0.0  # arrival to prefill start, summed
    # Prompt tokens the index showed cached on some worker at arrival beyond what the chosen one held:
    # hits given up by the routing choice, as opposed to never cached or evicted.
    routed_away_tokens: int = 0
    computed_tokens_by_worker: dict[str, int] = field(default_factory=dict)
    match_latencies_us: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def routed_away_rate(self) -> float:
        return self.routed_away_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def load_imbalance(self) -> float:
        """Max over mean of the uncached tokens each worker computed (1.0 = perfectly even)."""
        loads = list(self.computed_tokens_by_worker.values())
        mean = sum(loads) / len(loads) if loads else 0.0
        return max(loads) / mean if mean else 1.0

    @property
    def mean_queue_delay_s(self) -> float:
        return self.queue_delay_total_s / self.num_requests if self.num_requests else 0.0


class _BufferMethod:
    """Stands in for the prefill actor's `read_kv_events` Ray method: IndexFeeder awaits `.remote(seq)`."""

    def __init__(self, buffer: KVEventBuffer):
        self._buffer = buffer

    async def remote(self, since_seq: int):
        return self._buffer.read_since(since_seq)


class _TimedIndex:
    """The policy's view of the index: `match` is wall-timed; the policy calls nothing else."""

    def __init__(self, index: InProcessPrefixIndex, latencies_us: list[float]):
        self._index, self._latencies_us = index, latencies_us

    async def match(self, block_hashes):
        start_ns = time.perf_counter_ns()
        matches = await self._index.match(block_hashes)
        self._latencies_us.append((time.perf_counter_ns() - start_ns) / 1000)
        return matches


class PrefillReplay:
    """One policy, one replay: build, `await run(requests)`, then `await check_integrity()`."""

    def __init__(self, policy_name: str, config: SimConfig, prefix_blocks: int | None = None):
        self.config = config
        self.now_s = 0.0
        self.workers = {worker_id: SimWorker(worker_id, config) for worker_id in config.worker_ids()}
        self.index = InProcessPrefixIndex(config.index_lease_s, clock=lambda: self.now_s)
        handles = [
            SimpleNamespace(
                worker_id=w.worker_id, role="prefill", actor=SimpleNamespace(read_kv_events=_BufferMethod(w.events))
            )
            for w in self.workers.values()
        ]
        # A stand-in holding the two attributes IndexFeeder reads of a ClusterView.
        self.feeder = IndexFeeder(SimpleNamespace(members=handles, listeners=[]), self.index)  # type: ignore[arg-type]
        self.result = ReplayResult(policy_name, computed_tokens_by_worker=dict.fromkeys(self.workers, 0))
        self.policy = build_policy(policy_name, _TimedIndex(self.index, self.result.match_latencies_us), prefix_blocks)
        self.planner = PullPlanner(config.prefix_pull, config.kv_bytes_per_token)
        self._pending: list[tuple] = []  # heap of (time_s, kind, order, payload)
        self._order = itertools.count()

    async def run(self, requests: list[SimRequest]) -> ReplayResult:
        for request in requests:
            self._push(request.arrival_s, _ARRIVE, request)
        self._push(0.0, _FEED, None)
        while self._pending:
            self.now_s, kind, _, payload = heapq.heappop(self._pending)
            if kind == _DONE:
                self._finish(payload)
            elif kind == _FEED:
                await self.feeder.sync_once()
                if self._pending:  # keep feeding while anything else is due
                    self._push(self.now_s + self.config.feed_interval_s, _FEED, None)
            else:
                await self._route(payload)
        for worker in self.workers.values():
            self.result.computed_tokens_by_worker[worker.worker_id] = worker.computed_tokens
        return self.result

    async def check_integrity(self) -> None:
        """Every pool and table consistent and fully released, the index and the policy consistent."""
        for worker in self.workers.values():
            worker.kv.check_integrity()
            assert worker.kv.num_free_blocks == worker.kv.num_blocks, f"{worker.worker_id} still holds blocks"
            assert worker.running is None and not worker.waiting and worker.queued_prompt_tokens == 0
        await self.index.check_integrity()
        self.policy.check_integrity()

    async def _route(self, request: SimRequest) -> None:
        size = self.config.block_size
        prompt_key = np.asarray(request.token_ids, dtype="<u4").tobytes()  # as the router keys short prompts
        query = RouteQuery(request.block_hashes, request.num_prompt_tokens, size, prompt_key)
        decision = await self.policy.choose(query, [w.load() for w in self.workers.values()])
        # Measurement only, outside the timed lookups: the best holder the index knew of (the engine
        # computes the last token in any case, hence the cap).
        usable = (request.num_prompt_tokens - 1) // size
        held = {m.worker_id: min(m.num_blocks, usable) for m in await self.index.match(request.block_hashes)}
        self.result.routed_away_tokens += (max(held.values(), default=0) - held.get(decision.worker_id, 0)) * size
        # The router's estimate (router/service.py): what the policy does not expect cached, at least 1.
        worker = self.workers[decision.worker_id]
        pull = self.planner.plan(query, decision, self.workers.keys())
        pulled_blocks = 0 if pull is None else worker.pull_from(self.workers[pull.holder_id], request, pull.num_blocks)
        expected_blocks = decision.expected_cached_blocks if pull is None else pull.num_blocks
        estimate_tokens = max(request.num_prompt_tokens - expected_blocks * size, 1)
        pull_s = 0.0
        if pulled_blocks:
            num_bytes, pull_s = self._modelled_transfer(pulled_blocks * size)
            self.planner.observe_pull(PullOutcome(pulled_blocks, num_bytes, pull_s))
            self.result.pulled_tokens += pulled_blocks * size
        worker.enqueue(request, estimate_tokens, pull_s)
        if worker.running is None:
            self._start(worker)

    def _start(self, worker: SimWorker) -> None:
        request, cached_tokens, pull_s = worker.start_next()
        self.result.num_requests += 1
        self.result.prompt_tokens += request.num_prompt_tokens
        self.result.cached_tokens += cached_tokens
        self.result.queue_delay_total_s += self.now_s - request.arrival_s
        compute_s = (request.num_prompt_tokens - cached_tokens) / self.config.prefill_tokens_per_s
        self.planner.prefill_cost.observe(PrefillStep(request.num_prompt_tokens - cached_tokens, compute_s))
        # Its prompt KV then goes to decode over the same modelled link: the router learns pull costs from it.
        self.planner.observe_transfer(*self._modelled_transfer(request.num_prompt_tokens))
        # A pull still in flight when the request's turn comes delays it (charged to the worker: conservative).
        self._push(
            self.now_s + max(pull_s - (self.now_s - request.arrival_s), 0.0) + compute_s, _DONE, worker.worker_id
        )

    def _modelled_transfer(self, num_tokens: int) -> tuple[int, float]:
        num_bytes = num_tokens * self.config.kv_bytes_per_token
        return num_bytes, self.config.pull_latency_s + num_bytes / self.config.pull_bytes_per_s

    def _finish(self, worker_id: str) -> None:
        worker = self.workers[worker_id]
        worker.finish()
        if worker.waiting:
            self._start(worker)

    def _push(self, time_s: float, kind: int, payload) -> None:
        heapq.heappush(self._pending, (time_s, kind, next(self._order), payload))
