"""`cache_aware`: one cost per worker combining cached-prefix overlap and live load.

cost(worker) = queued prompt tokens already routed there
             + prompt tokens it would have to compute (the prompt minus the prefix it holds)

Both terms are prefill work in tokens, so they add without a tuning knob, and there is no two-tier
"cache first unless overloaded" switch: a long cached prefix wins until the holder's queue is longer
than the recompute elsewhere. Ties go to the longer cached prefix, then to the prompt's order on the
`prefix_hash` ring — so routers that share an index agree on a cold prefix too, and cold prefixes
spread over the workers instead of piling onto the lowest id.
The prefix comes from a `PrefixIndex` (in-process by default, Redis when configured); if the index
cannot answer, the choice falls back to `prefix_hash` for that request (no client-visible error).

With a shared KV store (`kv_store.url`), the store is a location too (`StoreLocation`): it holds the
prompt's first s blocks, and a worker holding n < s of them may fetch the other s - n instead of
computing them. Its cost is then

cost(worker) = queued + min(prompt - n blocks, fetch_tokens(s - n) + prompt - s blocks)

where `fetch_tokens` prices the fetch in prefill tokens (measured store read bandwidth over the fitted
per-token prefill time: policies/store_fetch_cost.py). The recompute term stays in tokens, so the two
add as before. The term only falls as n grows (fetch_tokens never falls as it fetches more), which is
what keeps the walk below exact. A store that cannot answer counts as holding nothing.

With host tiers (`kv_store.host_tier_bytes`), a worker whose host tier holds the blocks after its pool's
prefix may fetch them back: that option is scored apart, over the few workers the index reports it for
(policies/routing/host_tier_choice.py), and wins only when it costs strictly less than the walk's choice.

How the least cost is found without scoring every worker (the choice is exactly the least (cost,
-cached blocks, ring rank) over all workers; `ExhaustiveCacheAwarePolicy` computes it by definition and
the tests compare the two): the index answers with holder levels (`PrefixIndex.holder_levels`: the
workers holding exactly n leading blocks, for each n, deepest first), and the loads come as a
`LoadBook` (workers in load order). A worker holding n blocks costs at least the least queue of the
fleet plus the prompt minus n blocks, so levels are walked from the deepest and the walk stops at the
first level whose bound cannot beat the best found (a shallower level only costs more). Within a
level, a few holders are scored one by one; a large one (a system prompt everyone holds) is searched
in load order, where its first member is its least queued. Workers holding nothing come last, the same
way. Ties are ranked on the ring only among the tied workers (`PrefixHashPolicy.first_in_ring`).

When the holder levels are masks of the same worker slots as the book's (an in-process index and a
book sharing its `WorkerSlots`, as in the simulator), each of those searches is done with masks
instead of worker by worker: a level's least queued member is the first queue length whose mask meets
the level's, a tie is the AND of a queue length's mask with a level's, and the ring walk tests a bit
per point. Same choices, a few ANDs of fleet-wide ints instead of a Python call per worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from engine.block_hash import BlockHash
from policies.routing.base import RouteDecision, RouteQuery, RoutingPolicy, WorkerLoad, require_workers
from policies.routing.host_tier_choice import HostTierLocation, best_host_fetch
from policies.routing.load_book import LoadBook, as_book
from policies.routing.prefix_hash import FEW_TIED, PrefixHashPolicy
from prefix_index.base import HolderLevels, MatchLevels
from prefix_index.worker_slots import WorkerSlots

log = logging.getLogger(__name__)

_NO_HOLDERS = MatchLevels(())
LOAD_WALK_STEPS = 64  # workers a level's search in load order passes before it lists the level instead


class StoreLocation(Protocol):
    """The shared KV store as a place a prompt's blocks can be: how many it holds, what fetching costs."""

    async def held_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `block_hashes` the store holds (0 when it cannot tell)."""

    def fetch_tokens(self, num_blocks: int) -> int:
        """A fetch of `num_blocks` blocks from the store, in prefill tokens (0 for none; never falls as
        `num_blocks` grows)."""


def uncached_cost(query: RouteQuery, blocks: int, store_blocks: int, store: StoreLocation | None) -> int:
    """What a worker holding `blocks` leading blocks spends on the prompt besides its queue, in tokens:
    computing what it lacks, or fetching what the store adds and computing the rest, whichever is less."""
    # A hit never covers the whole prompt: the last token is always computed (it yields the first
    # output token), so the uncached count is at least one.
    prompt, size = query.num_prompt_tokens, query.block_size
    own = max(prompt - blocks * size, 1)
    if store is None or store_blocks <= blocks:
        return own
    return min(own, store.fetch_tokens(store_blocks - blocks) + max(prompt - store_blocks * size, 1))


def fetched_blocks(query: RouteQuery, blocks: int, store_blocks: int, store: StoreLocation | None) -> int:
    """The blocks a worker holding `blocks` is priced as fetching from the store (0: it computes them)."""
    if uncached_cost(query, blocks, store_blocks, store) < uncached_cost(query, blocks, 0, None):
        return store_blocks - blocks
    return 0


class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, index, fallback: PrefixHashPolicy | None = None, store: StoreLocation | None = None):
        self.index = index  # prefix_index.PrefixIndex
        self.fallback = fallback or PrefixHashPolicy()
        self.store = store
        self.host_tier: HostTierLocation | None = None  # prices fetches from a worker's own host tier
        self.index_failures = 0
        self.store_failures = 0
        self._degraded = False

    async def choose(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> RouteDecision:
        require_workers(workers)
        if not query.block_hashes:  # nothing cacheable: the least loaded, ties in ring order
            return self._decide(query, workers, _NO_HOLDERS)
        try:
            levels = await self._holder_levels(query)
        except Exception as err:  # noqa: BLE001 - an unreachable index degrades routing, never the request
            self.index_failures += 1
            if not self._degraded:
                log.warning("prefix index unavailable (%s); routing by prefix_hash until it returns", err)
            self._degraded = True
            return self.fallback.choose_now(query, workers)
        self._degraded = False
        return self._decide(query, workers, levels, await self._store_blocks(query))

    def holder_slots(self) -> WorkerSlots | None:
        return getattr(self.index, "slots", None)  # an index of the PrefixIndex contract says; others have none

    def locate_store(self, store: StoreLocation) -> None:
        self.store = store

    def locate_host_tier(self, host: HostTierLocation) -> None:
        self.host_tier = host

    def _with_host_fetch(
        self,
        query: RouteQuery,
        workers: Sequence[WorkerLoad],
        levels: HolderLevels,
        store_blocks: int,
        decision: RouteDecision,
        cost: int,
    ) -> RouteDecision:
        """`decision` (costing `cost`), or a worker fetching from its own host tier when that costs less
        (policies/routing/host_tier_choice.py)."""
        host = self.host_tier
        extended = levels.host_extended() if host is not None else ()
        if host is None or not extended:
            return decision
        book = as_book(workers)

        def queued_of(worker_id: str) -> int | None:
            load = book.get(worker_id)
            return None if load is None else load.queued_prompt_tokens

        choice = best_host_fetch(
            query,
            extended,
            queued_of,
            lambda n: uncached_cost(query, n, store_blocks, self.store),
            host,
            lambda among: self.fallback.first_in_ring(query, book, set(among)),
        )
        if choice is None or choice.cost >= cost:
            return decision
        reach = choice.pool_blocks + choice.host_blocks
        return RouteDecision(
            choice.worker_id,
            choice.pool_blocks,
            store_blocks=fetched_blocks(query, reach, store_blocks, self.store),
            host_blocks=choice.host_blocks,
        )

    async def _store_blocks(self, query: RouteQuery) -> int:
        if self.store is None:
            return 0
        try:
            return await self.store.held_blocks(query.block_hashes)
        except Exception:  # noqa: BLE001 - a store that cannot answer holds nothing, as for a worker
            self.store_failures += 1
            return 0

    async def _holder_levels(self, query: RouteQuery) -> HolderLevels:
        return await self.index.holder_levels(query.block_hashes)

    def _decide(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], levels: HolderLevels, store_blocks: int = 0
    ) -> RouteDecision:
        book = as_book(workers)
        blocks, queued = self._least_cost(
            query, book, levels, lambda n: uncached_cost(query, n, store_blocks, self.store)
        )
        decision = RouteDecision(
            self._first_tied(query, book, levels, blocks, queued),
            blocks,
            store_blocks=fetched_blocks(query, blocks, store_blocks, self.store),
        )
        cost = queued + uncached_cost(query, blocks, store_blocks, self.store)
        decision = self._with_host_fetch(query, book, levels, store_blocks, decision, cost)
        holder = self._best_holder(query, book, levels)
        if holder is None:
            return decision
        return decision._replace(holder_id=holder[0], holder_blocks=holder[1])

    @staticmethod
    def _least_cost(
        query: RouteQuery, book: LoadBook, levels: HolderLevels, uncached_of: Callable[[int], int]
    ) -> tuple[int, int]:
        """(cached blocks, queued tokens) of the least (cost, -cached blocks) over the book's workers;
        `uncached_of(n)`: the cost besides its queue of a worker holding n blocks (never rising in n)."""
        floor_queued = book.min_queued()
        best: tuple[int, int, int] | None = None  # (cost, -blocks, queued)
        for blocks in (*levels.depths, 0):
            uncached = uncached_of(blocks)
            if best is not None and floor_queued + uncached >= best[0]:
                break  # this level and every shallower one cost at least the best found
            queued = _least_queued_at(book, levels, blocks, None if best is None else best[0] - uncached)
            if queued is not None and (best is None or (queued + uncached, -blocks) < best[:2]):
                best = (queued + uncached, -blocks, queued)
        assert best is not None, "a non-empty book has a least-cost worker"
        return -best[1], best[2]

    def _first_tied(self, query: RouteQuery, book: LoadBook, levels: HolderLevels, blocks: int, queued: int) -> str:
        """The first in ring order of the workers holding `blocks` blocks with `queued` tokens queued."""
        if _masked(book, levels):
            holding = levels.exact_mask(blocks) if blocks else ~_holding_any(levels)
            return self._first_in_mask(query, book, book.mask_with_queued(queued) & holding)

        def tied(worker_id: str) -> bool:
            load = book.get(worker_id)
            return load is not None and load.queued_prompt_tokens == queued and levels.blocks_of(worker_id) == blocks

        # A small tie is listed from whichever side is small (the workers with that queue, or the level)
        # and ranked directly; a large one (an idle fleet, a prefix everyone holds) meets a member within
        # a few steps of the ring, and the walk's first member is the answer by definition.
        same_queue = book.count_queued(queued)
        if same_queue <= FEW_TIED:
            among = {w for w in book.with_queued(queued) if levels.blocks_of(w) == blocks}
        elif blocks and levels.count(blocks) <= FEW_TIED:
            among = {w for w in levels.members(blocks) if tied(w)}
        elif (found := self.fallback.first_in_ring_where(query, book, tied, limit=FEW_TIED)) is not None:
            return found
        else:
            # Listed from the smaller side (a level's members list cheaply, by its index's masks), until
            # it proves large enough for the ring walk.
            if blocks and levels.count(blocks) < same_queue:
                candidates = (w for w in levels.members(blocks) if tied(w))
            else:
                candidates = (w for w in book.with_queued(queued) if levels.blocks_of(w) == blocks)
            among = set()
            for worker_id in candidates:
                among.add(worker_id)
                if len(among) > FEW_TIED:
                    found = self.fallback.first_in_ring_where(query, book, tied)
                    assert found is not None, "the tied worker exists"
                    return found
        return self.fallback.first_in_ring(query, book, among)

    def _first_in_mask(self, query: RouteQuery, book: LoadBook, mask: int) -> str:
        """The first in ring order of the book's workers in `mask` (not empty)."""
        assert book.slots is not None and mask, "a tie has members"
        if mask.bit_count() <= FEW_TIED:
            return self.fallback.first_in_ring(query, book, set(book.slots.owners_of(mask)))
        found = self.fallback.first_in_ring_mask(query, book, mask, book.slots)
        assert found is not None, "the ring holds every worker of the book"
        return found

    def _best_holder(self, query: RouteQuery, book: LoadBook, levels: HolderLevels) -> tuple[str, int] | None:
        """The worker of the book holding the most leading blocks (ties: ring order), and how many."""
        if _masked(book, levels):
            for blocks in levels.depths:
                mask = levels.exact_mask(blocks) & book.mask
                if mask:
                    return self._first_in_mask(query, book, mask), blocks
            return None
        for blocks in levels.depths:
            if levels.count(blocks) <= FEW_TIED:
                among = {w for w in levels.members(blocks) if book.has(w)}
                if among:
                    return self.fallback.first_in_ring(query, book, among), blocks
                continue
            found = self.fallback.first_in_ring_where(query, book, _holding(levels, blocks))
            if found is not None:
                return found, blocks
        return None


def _masked(book: LoadBook, levels: HolderLevels) -> bool:
    """Whether the levels' masks and the book's are in the same worker slots."""
    return levels.slots is not None and levels.slots is book.slots


def _holding_any(levels: HolderLevels) -> int:
    return levels.holding_at_least(levels.depths[-1]) if levels.depths else 0


def _holding(levels: HolderLevels, blocks: int) -> Callable[[str], bool]:
    return lambda worker_id: levels.blocks_of(worker_id) == blocks


def _least_queued_at(book: LoadBook, levels: HolderLevels, blocks: int, below: int | None) -> int | None:
    """The least queued tokens of a worker holding exactly `blocks` blocks (a small level, listed), or
    at least `blocks` blocks (a large one, walked); None when there is none or none queues less than
    `below`.

    Counting the workers that hold more in a level leaves `_least_cost`'s answer unchanged: such a
    worker's term (its queue plus the level's uncached cost) is no less than its own cost (uncached cost
    never rises with the blocks held), and at the best level any worker queueing less would cost less.
    It makes the walk short: the workers holding at least a hot system prompt are nearly all, so the
    least loaded is a member (and at 0 blocks every worker is: the book's least)."""
    if blocks and levels.count(blocks) <= FEW_TIED:
        return _least_listed(book, levels, blocks, below)
    if _masked(book, levels):
        return _least_queued_masked(book, levels, blocks, below)
    # The first worker met in load order holding enough is the least queued. The walk passes the less
    # loaded workers of shallower levels first: past LOAD_WALK_STEPS of them the level is listed instead.
    for steps, load in enumerate(book.ascending()):
        if below is not None and load.queued_prompt_tokens >= below:
            return None
        if levels.blocks_of(load.worker_id) >= blocks:
            return load.queued_prompt_tokens
        if blocks and steps >= LOAD_WALK_STEPS:
            return _least_listed(book, levels, blocks, below)
    return None


def _least_queued_masked(book: LoadBook, levels: HolderLevels, blocks: int, below: int | None) -> int | None:
    """`_least_queued_at` for a large level with masks: the first queue length (ascending) whose workers
    meet the holders of at least `blocks` blocks; past LOAD_WALK_STEPS lengths the level is listed."""
    holding = levels.holding_at_least(blocks) if blocks else book.mask
    for steps, (queued, mask) in enumerate(book.masks_ascending()):
        if below is not None and queued >= below:
            return None
        if mask & holding:
            return queued
        if steps >= LOAD_WALK_STEPS:
            return _least_listed(book, levels, blocks, below)
    return None


def _least_listed(book: LoadBook, levels: HolderLevels, blocks: int, below: int | None) -> int | None:
    """`_least_queued_at` by listing the level's members."""
    least = book.least_queued_of(levels.members(blocks))
    return least if least is not None and (below is None or least < below) else None


class ExhaustiveCacheAwarePolicy(CacheAwarePolicy):
    """`cache_aware` by its definition: every worker scored (the reference the tests and the routing
    benchmark compare the walk above with). It reads the index's full `match` list, as a policy that
    scores every worker needs."""

    async def _holder_levels(self, query: RouteQuery) -> HolderLevels:
        return MatchLevels(await self.index.match(query.block_hashes))

    def _decide(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], levels: HolderLevels, store_blocks: int = 0
    ) -> RouteDecision:
        cached = {w.worker_id: levels.blocks_of(w.worker_id) for w in workers}
        key = {
            w.worker_id: (
                w.queued_prompt_tokens + uncached_cost(query, cached[w.worker_id], store_blocks, self.store),
                -cached[w.worker_id],
            )
            for w in workers
        }
        best = min(key.values())
        decision = RouteDecision(
            self.fallback.first_in_ring(query, workers, {w for w, k in key.items() if k == best}),
            -best[1],
            store_blocks=fetched_blocks(query, -best[1], store_blocks, self.store),
        )
        decision = self._with_host_fetch(query, workers, levels, store_blocks, decision, best[0])
        most = max(cached.values())
        if not most:
            return decision
        holder = self.fallback.first_in_ring(query, workers, {w for w, n in cached.items() if n == most})
        return decision._replace(holder_id=holder, holder_blocks=most)
