"""The simulated router: the router's own routing policy objects over its ledger and prefix index.

- the policy: `policies.routing.make_policy(name, index)`, the objects the router builds; their async
  `choose` is driven synchronously (`sim.drive.run_now`): the in-process index never waits;
- the ledger (router/ledger.py), here as plain counters: per prefill worker, requests in flight
  (booked at routing, released at their end or migration) and uncached prompt tokens routed there and
  not prefilled yet, the `WorkerLoad`s the policy reads; per decode instance, requests in flight from
  routing to their end;
- the prefix index: the real `prefix_index.memory.InProcessPrefixIndex`, leases on the simulated clock,
  fed each prefill worker's real `BlockPool` events as the router's index feeder pulls them from the
  worker's `KVEventBuffer` (a numbered batch since the cursor, applied, the lease refreshed). The simulator pulls
  before every routing choice, where the router polls every 50 ms (its index may lag by that much); a
  worker that dies leaves the index at once, as the feeder drops a member that left, and its
  replacement starts a new epoch. Live workers' leases are refreshed every half lease (`heartbeat`).
- the prefix-pull planner: the router's own `policies.prefix_pull.PullPlanner` (`SimConfig.prefix_pull`),
  asked after each choice whether the chosen worker pulls the prefix the index shows on a better
  holder; its models learn from the simulated prefill steps and KV transfers (hand-offs and pulls), as
  the router's learn from the workers' reports (with admission on, it reads the admission gate's prefill
  model, as the router's does);
Worker ids are "prefill-<i>", so the policy's last tie-break (`cache_aware` and `prefix_hash`: the
prompt's ring order; `least_loaded`, `round_robin`: the id) is the router's. Decode instances: the
fewest requests in flight, ties to the lower index (router/worker_choice.py).
The ledger's counters change in O(1) per booking and keep the live workers' loads in a `LoadBook`
(load order), which the policies walk instead of scanning the fleet (policies/routing/load_book.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from common.kv_events import KVEventBatch
from common.messages import PrefixPull
from engine.block_hash import BlockHash
from engine.block_pool import KVCacheEvent
from policies.admission import PrefillCostModel
from policies.prefix_pull import PullPlanner
from policies.routing import LoadBook, RouteQuery, WorkerLoad, make_policy
from prefix_index.memory import InProcessPrefixIndex
from prefix_index.worker_slots import WorkerSlots
from sim.drive import run_now

INDEX_LEASE_S = 30.0  # ClusterConfig.index_lease_s's default


class PrefillChoice(NamedTuple):
    worker: int
    uncached: int  # the tokens the router books on the worker's queue: what it expects to be computed
    pull: PrefixPull | None = None  # the prefix the worker is to pull first, if any


class LeastHeap:
    """The index with the least value (ties: the lower index) among live entries, values changing."""

    def __init__(self, size: int):
        self.values = [0] * size
        self.alive = [True] * size
        self._heap = [(0, i) for i in range(size)]

    def add(self, index: int, delta: int) -> None:
        self.values[index] += delta
        heapq.heappush(self._heap, (self.values[index], index))
        if len(self._heap) > 4 * len(self.values) + 64:
            self._heap = [(v, i) for i, v in enumerate(self.values) if self.alive[i]]
            heapq.heapify(self._heap)

    def set_alive(self, index: int, alive: bool) -> None:
        self.alive[index] = alive
        if alive:
            heapq.heappush(self._heap, (self.values[index], index))

    def least(self) -> int | None:
        heap = self._heap
        while heap:
            value, index = heap[0]
            if self.alive[index] and self.values[index] == value:
                return index
            heapq.heappop(heap)
        return None


@dataclass(eq=False)
class _Feed:
    """One prefill worker's start: its events not yet applied, and what the index applied of it.

    The worker's `KVEventBuffer` would hand the feeder these same events, numbered from the cursor (or,
    past its capacity, a snapshot that leaves the index the same); the simulator reads before every
    choice, so it keeps the pending events as they are and applies them as one batch."""

    worker_id: str
    epoch: int
    live: bool = True
    cursor: int = 0  # the last sequence number applied
    fed_s: float = 0.0  # when its lease was last refreshed
    pending: list[KVCacheEvent] = field(default_factory=list)

    def append(self, event: KVCacheEvent) -> None:
        if self.live:  # a dead worker's pool may still release blocks: the index no longer follows it
            self.pending.append(event)


class SimRouter:
    def __init__(
        self,
        policy: str,
        num_prefill: int,
        num_decode: int,
        block_tokens: int,
        clock: Callable[[], float],
        prefix_pull: str = "never",
        kv_bytes_per_token: int = 0,
        prefill_cost: PrefillCostModel | None = None,
    ):
        self.block_tokens, self.clock = block_tokens, clock
        self.ids = [f"prefill-{i}" for i in range(num_prefill)]
        self.index_of = {worker_id: i for i, worker_id in enumerate(self.ids)}
        self.healthy = set(self.ids)
        self.planner = PullPlanner(prefix_pull, kv_bytes_per_token, prefill_cost)
        self.queued = [0] * num_prefill  # uncached prompt tokens awaiting a first token
        self.inflight = [0] * num_prefill  # requests booked, not ended
        self.alive = [True] * num_prefill
        self._loads = [WorkerLoad(worker_id, 0, 0) for worker_id in self.ids]
        # The index and the book share worker slots (ids are fixed: slot i is prefill-i), so the policy
        # meets holders and ties with masks (policies/routing/cache_aware.py).
        slots = WorkerSlots()
        for worker_id in self.ids:
            slots.slot(worker_id)
        self._book = LoadBook(self._loads, slots)  # the live workers' loads, in load order (what the policy reads)
        self.decode_inflight = LeastHeap(num_decode)  # requests in flight per decode instance
        self.index = InProcessPrefixIndex(INDEX_LEASE_S, clock, slots)
        self.policy = make_policy(policy, self.index)
        self._feeds: list[_Feed | None] = [None] * num_prefill
        self._dirty: set[int] = set()  # workers with events the index has not applied

    # ---- the index feed ---------------------------------------------------------------------------
    def on_event(self, worker: int) -> Callable[[KVCacheEvent], None]:
        """The BlockPool event sink of a new start of prefill worker `worker` (a new epoch)."""
        old = self._feeds[worker]
        epoch = 1 if old is None else old.epoch + 1
        feed = _Feed(self.ids[worker], epoch)
        self._feeds[worker] = feed

        def sink(event: KVCacheEvent) -> None:
            feed.append(event)
            self._dirty.add(worker)

        return sink

    def pull(self) -> None:
        """Applies every worker's new events, as the feeder's next poll would."""
        for worker in sorted(self._dirty):
            feed = self._feeds[worker]
            if feed is None or not feed.live:
                continue
            if feed.pending:
                last_seq = feed.cursor + len(feed.pending)
                events = tuple(enumerate(feed.pending, feed.cursor + 1))
                run_now(self.index.apply(KVEventBatch(feed.worker_id, feed.epoch, last_seq, events)))
                feed.cursor, feed.fed_s = last_seq, self.clock()
                feed.pending.clear()
        self._dirty.clear()

    def heartbeat(self) -> None:
        """Refreshes the lease of every live worker not fed for half a lease (the feeder's heartbeats)."""
        self.pull()
        now_s = self.clock()
        for worker, feed in enumerate(self._feeds):
            if feed is not None and feed.live and feed.cursor and now_s - feed.fed_s >= INDEX_LEASE_S / 2:
                run_now(self.index.heartbeat(self.ids[worker], feed.epoch))
                feed.fed_s = now_s

    # ---- membership -------------------------------------------------------------------------------
    def set_alive(self, role: str, index: int, alive: bool) -> None:
        if role == "decode":
            self.decode_inflight.set_alive(index, alive)
            return
        self.alive[index] = alive
        if alive:
            self.healthy.add(self.ids[index])
            self._book.set(self._loads[index])
        else:
            self.healthy.discard(self.ids[index])
            self._book.remove(self.ids[index])
        feed = self._feeds[index]
        if not alive and feed is not None:
            feed.live = False
            self._dirty.discard(index)
            run_now(self.index.remove_worker(self.ids[index]))

    # ---- the ledger -------------------------------------------------------------------------------
    def book(self, worker: int, uncached: int) -> None:
        self.queued[worker] += uncached
        self.inflight[worker] += 1
        self._set_load(worker)

    def load(self, worker: int) -> WorkerLoad:
        """The worker's load as the routing policy saw it (admission reads the same figures)."""
        return self._loads[worker]

    def first_token(self, worker: int, uncached: int) -> None:
        self.queued[worker] -= uncached
        self._set_load(worker)

    def release(self, worker: int, queued: int) -> None:
        """Ends a booking; `queued`: what is still queued of it (0 once its first token came)."""
        self.queued[worker] -= queued
        self.inflight[worker] -= 1
        self._set_load(worker)

    def _set_load(self, worker: int) -> None:
        load = self._loads[worker] = WorkerLoad(self.ids[worker], self.inflight[worker], self.queued[worker])
        if self.alive[worker]:
            self._book.set(load)

    # ---- choices ----------------------------------------------------------------------------------
    def choose_prefill(self, keys: Sequence[BlockHash], prompt_tokens: int, prompt_key: bytes) -> PrefillChoice | None:
        """The prefill worker, what the router books on it, and its pull; None when no worker serves."""
        if not self._book:
            return None
        self.pull()
        query = RouteQuery(tuple(keys), prompt_tokens, self.block_tokens, prompt_key)
        decision = run_now(self.policy.choose(query, self._book))
        pull = self.planner.plan(query, decision, self.healthy)
        # As router/service.py: with a pull the router expects the pulled prefix cached.
        expected = decision.expected_cached_blocks if pull is None else pull.num_blocks
        uncached = max(prompt_tokens - expected * self.block_tokens, 1)
        return PrefillChoice(self.index_of[decision.worker_id], uncached, pull)

    def choose_decode(self) -> int | None:
        return self.decode_inflight.least()
