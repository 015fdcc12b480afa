"""The simulated router: routing policies, its load ledger and prefix index, admission.

It models router/ (which `cluster/` may not import: the simulator serves the controller's planner):
- the ledger (router/ledger.py): per prefill worker, uncached prompt tokens routed there and not
  prefilled yet; per decode instance, requests in flight from routing to their end;
- the prefix index (prefix_index/): which worker holds which block, fed by the workers'
  real BlockPool events (at once: the real index lags by up to one 50 ms poll);
- `cache_aware` (policies/routing/cache_aware.py): cost = queued uncached tokens + the prompt's tokens
  the worker does not hold, lowest wins, ties to the longer cached prefix, then the lower index (the
  real policy breaks the last tie in prefix-hash ring order); `least_loaded`: the same without the
  cache; `round_robin`; decode instances: fewest requests in flight (router/worker_choice.py `_pick`);
- admission `always`, or `ttft`: refuse a request whose predicted TTFT on its worker (queued tokens
  plus its own at the profile's prefill rate) exceeds the SLO, as `predictive` does for TTFT.
tests/cluster/test_sim_router.py holds `cache_aware` here to the router's own policy on the same loads and
holdings (cost and cached blocks), and to a brute-force walk of every worker.
Everything is O(log workers) per request except the walk over holders of the prompt's blocks (see
`choose_prefill` for what keeps that short on large fleets).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from engine.block_pool import BlockRemoved, BlockStored


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


class PrefixIndex:
    """block key -> prefill workers holding it; `on_event(worker)` is a BlockPool event sink."""

    def __init__(self):
        self.holders: dict[Hashable, set[int]] = {}

    def on_event(self, worker: int):
        def apply(event) -> None:
            if isinstance(event, BlockStored):
                for key in event.block_hashes:
                    self.holders.setdefault(key, set()).add(worker)
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    held = self.holders.get(key)
                    if held is not None:
                        held.discard(worker)
                        if not held:
                            del self.holders[key]

        return apply

    def drop_worker(self, worker: int, keys) -> None:
        self.on_event(worker)(BlockRemoved(tuple(keys)))

    def levels(self, keys: Sequence[Hashable]) -> list[tuple[int, set[int]]]:
        """(d, the workers holding the first d blocks of `keys`) for d = 1, 2, ... while any does. The
        sets are the index's own or fresh intersections: read them, never change them."""
        found: list[tuple[int, set[int]]] = []
        current: set[int] | None = None
        for depth, key in enumerate(keys, start=1):
            held = self.holders.get(key)
            current = held if current is None else (current & held if held else None)
            if not current:
                break
            found.append((depth, current))
        return found


class SimRouter:
    def __init__(self, policy: str, num_prefill: int, num_decode: int, block_tokens: int):
        self.policy, self.block_tokens = policy, block_tokens
        self.queued = LeastHeap(num_prefill)  # uncached prompt tokens awaiting a first token
        self.inflight = LeastHeap(num_decode)  # requests in flight per decode instance
        self.index = PrefixIndex()
        self._turn = 0

    def set_alive(self, role: str, index: int, alive: bool) -> None:
        (self.queued if role != "decode" else self.inflight).set_alive(index, alive)

    def choose_prefill(self, keys: Sequence[Hashable], prompt_tokens: int) -> tuple[int, int] | None:
        """(worker, the uncached tokens booked on its queue), None when no worker serves."""
        least = self.queued.least()
        if least is None:
            return None
        if self.policy == "round_robin":
            serving = [i for i, ok in enumerate(self.queued.alive) if ok]
            worker = serving[self._turn % len(serving)]
            self._turn += 1
            return worker, prompt_tokens
        queued, alive = self.queued.values, self.queued.alive
        best = (queued[least] + prompt_tokens, 0, least)
        if self.policy == "cache_aware" and keys:
            # Each worker at every depth it holds: a shallower depth never beats its deepest, so the least
            # (cost, -blocks, worker) is the policy's. Deepest first; a level whose cost cannot go below
            # the least-queued worker's is skipped, and one that worker holds costs its queue: fleets of
            # thousands of workers all hold a popular first block, and a scan of them cost ~1 ms a request.
            floor = queued[least]
            for blocks, holders in reversed(self.index.levels(keys)):
                uncached = max(prompt_tokens - blocks * self.block_tokens, 1)
                if (floor + uncached, -blocks) > best[:2]:
                    continue
                if least in holders:
                    best = min(best, (floor + uncached, -blocks, least))
                else:
                    best = min([best, *((queued[w] + uncached, -blocks, w) for w in holders if alive[w])])
        _, neg_blocks, worker = best
        return worker, max(prompt_tokens + neg_blocks * self.block_tokens, 1)

    def choose_decode(self) -> int | None:
        return self.inflight.least()
