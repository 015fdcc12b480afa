"""`prefix_hash`: consistent hashing of the prompt's leading block hashes onto the workers.

Prompts that share their first `prefix_blocks` blocks land on the same worker, so its prefix cache
serves them. The ring has `virtual_nodes` points per worker, so when a worker joins or leaves only
the keys of the arc it gains or loses move (about 1/N of them), not everything.

Loads are bounded (consistent hashing with bounded loads, after Mirrokni et al. 2018), in tokens of
prefill work: a worker keeps a key while its queued uncached prompt tokens stay within
max(load_factor · (all workers' queued tokens + this prompt's) / workers, slack_tokens); otherwise the
request goes to the next worker met walking the ring from its key. One hot prefix — a system prompt
shared by a whole workload — then spreads over a few workers in ring order instead of queueing on
one, while a worker with less than `slack_tokens` queued (about two prefill steps) always keeps its
keys, so ordinary load never breaks affinity. `load_factor=None` ignores load (the pure ring). Every
router computes the same ring order; the loads are each router's own. Measured on the Mooncake trace
(README): with the ring keyed on 2 blocks, which every request shares, the pure ring queues for minutes
on one worker and the bound keeps the mean queue near 0.1 s; keyed on 5 blocks it costs 6% of the
hits.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from policies.routing.base import RouteDecision, RouteQuery, RoutingPolicy, WorkerLoad, require_workers
from policies.routing.load_book import LoadBook
from prefix_index.worker_slots import WorkerSlots

DEFAULT_PREFIX_BLOCKS = 2
DEFAULT_VIRTUAL_NODES = 128
DEFAULT_LOAD_FACTOR = 1.25  # the paper's choice: few moved keys, no worker far above the mean
DEFAULT_SLACK_TOKENS = 4096  # about two prefill steps of the default 2048-token budget


_RING_SIZE = 1 << 64
# A tie among at most this many workers is ranked by their own points; a larger one by walking the ring
# until a member is met (about members / fleet of the ring's points): the cheaper of the two either way.
FEW_TIED = 32


def ring_point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring over a fixed set of worker ids."""

    def __init__(self, worker_ids: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES):
        # Sorted by point, then by the order of `worker_ids` (sorted ids: a tie of two points, as likely
        # as a 64-bit collision, goes to the smaller id); the points sort as plain ints, not as tuples.
        labels = [(worker_id, f"{worker_id}#{i}".encode()) for worker_id in worker_ids for i in range(virtual_nodes)]
        raw = [ring_point(label) for _, label in labels]
        order = sorted(range(len(raw)), key=raw.__getitem__)
        self.points = [raw[i] for i in order]
        self.owners = [labels[i][0] for i in order]
        self.worker_ids = frozenset(worker_ids)
        self._own_points: dict[str, list[int]] = {}  # each worker's points, sorted
        self._point_slots: tuple[WorkerSlots, int, list[int]] | None = None  # (registry, its releases, slots)
        for point, worker_id in zip(self.points, self.owners, strict=True):
            self._own_points.setdefault(worker_id, []).append(point)

    def owner(self, key: bytes) -> str:
        index = bisect.bisect(self.points, ring_point(key)) % len(self.points)
        return self.owners[index]

    def walk(self, key: bytes) -> Iterator[str]:
        """Every worker once, in the order met walking the ring from the key: the owner first, then
        who would own the key if the owner left, and so on. Every router computes the same order."""
        start = bisect.bisect(self.points, ring_point(key))
        seen: set[str] = set()
        for offset in range(len(self.owners)):
            owner = self.owners[(start + offset) % len(self.owners)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.worker_ids):
                    return

    def preference(self, key: bytes) -> list[str]:
        return list(self.walk(key))

    def first_in_mask(self, key: bytes, mask: int, slots: WorkerSlots) -> str | None:
        """The first worker met walking from the key whose bit (in `slots`) `mask` sets; None when none
        does. A point whose owner is not a member is passed at the cost of a shift and a test: no set of
        workers met is kept, since the first hit ends the walk."""
        point_slots = self._slots_of_points(slots)
        start = bisect.bisect(self.points, ring_point(key))
        for index in itertools.chain(range(start, len(point_slots)), range(start)):
            if mask >> point_slots[index] & 1:
                return self.owners[index]
        return None

    def _slots_of_points(self, slots: WorkerSlots) -> list[int]:
        cached = self._point_slots
        if cached is None or cached[0] is not slots or cached[1] != slots.releases:
            cached = self._point_slots = (slots, slots.releases, [slots.slot(owner) for owner in self.owners])
        return cached[2]

    def first_of(self, key: bytes, among: Iterable[str]) -> str:
        """The first of `among` (a few members) met walking from the key: each member's distance to its
        next point, without walking past the others' points."""
        start = ring_point(key)

        def distance(worker_id: str) -> tuple[int, str]:
            own = self._own_points[worker_id]
            i = bisect.bisect(own, start)
            point = own[i] if i < len(own) else own[0]
            return ((point - start - 1) % _RING_SIZE, worker_id)  # a point equal to the key's comes last

        return min(among, key=distance)


def prefix_key(query: RouteQuery, prefix_blocks: int) -> bytes:
    """The chained hash of block min(prefix_blocks, n) - 1 covers all blocks before it too."""
    if query.block_hashes:
        return bytes(query.block_hashes[min(prefix_blocks, len(query.block_hashes)) - 1])
    return query.prompt_key


class PrefixHashPolicy(RoutingPolicy):
    name = "prefix_hash"

    def __init__(
        self,
        prefix_blocks: int = DEFAULT_PREFIX_BLOCKS,
        virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
        load_factor: float | None = DEFAULT_LOAD_FACTOR,
        slack_tokens: int = DEFAULT_SLACK_TOKENS,
    ):
        if prefix_blocks < 1 or virtual_nodes < 1:
            raise ValueError("prefix_blocks and virtual_nodes must be >= 1")
        if load_factor is not None and not (math.isfinite(load_factor) and load_factor >= 1.0):
            raise ValueError(f"load_factor must be None or >= 1, got {load_factor!r}")
        if slack_tokens < 0:
            raise ValueError(f"slack_tokens must be >= 0, got {slack_tokens}")
        self.prefix_blocks, self.virtual_nodes = prefix_blocks, virtual_nodes
        self.load_factor, self.slack_tokens = load_factor, slack_tokens
        self._ring: HashRing | None = None

    async def choose(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> RouteDecision:
        return self.choose_now(query, workers)

    def choose_now(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> RouteDecision:
        """The same choice without awaiting (cache_aware falls back to it from inside its own choose)."""
        require_workers(workers)
        ring, key = self._ring_for(workers), prefix_key(query, self.prefix_blocks)
        if self.load_factor is None:
            return RouteDecision(ring.owner(key), 0)
        loads: dict[str, WorkerLoad] | LoadBook
        if isinstance(workers, LoadBook):
            total, loads = workers.total_queued, workers
        else:
            total, loads = sum(w.queued_prompt_tokens for w in workers), {w.worker_id: w for w in workers}
        mean_tokens = (total + query.num_prompt_tokens) / len(workers)
        bound = max(self.load_factor * mean_tokens, self.slack_tokens)
        # Some worker is within the bound: the least loaded holds at most the mean, below it.
        return RouteDecision(next(w for w in ring.walk(key) if _queued(loads, w) <= bound), 0)

    def preference(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> list[str]:
        """The workers in this prompt's ring order (see HashRing.preference)."""
        return self._ring_for(workers).preference(prefix_key(query, self.prefix_blocks))

    def first_in_ring(self, query: RouteQuery, workers: Sequence[WorkerLoad], among: set[str]) -> str:
        """The first of `among` (ids of some of `workers`) in this prompt's ring order: what ranking all
        of `workers` by `preference` and taking the best of `among` gives, without ranking the rest."""
        if len(among) == 1:
            return next(iter(among))
        ring, key = self._ring_for(workers), prefix_key(query, self.prefix_blocks)
        if len(among) <= FEW_TIED:
            return ring.first_of(key, among)
        return next(w for w in ring.walk(key) if w in among)

    def first_in_ring_mask(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], mask: int, slots: WorkerSlots
    ) -> str | None:
        """`first_in_ring_where` for the members of a mask (bits of `slots`; only of `workers`' ids)."""
        return self._ring_for(workers).first_in_mask(prefix_key(query, self.prefix_blocks), mask, slots)

    def first_in_ring_where(
        self, query: RouteQuery, workers: Sequence[WorkerLoad], accept: Callable[[str], bool], limit: int = 0
    ) -> str | None:
        """The first worker met in this prompt's ring order that `accept`s, looking at the first `limit`
        workers (0: all); None when none of those does. For a set too large to list, the walk meets a
        member after about fleet / members workers."""
        walk = self._ring_for(workers).walk(prefix_key(query, self.prefix_blocks))
        if limit:
            walk = itertools.islice(walk, limit)
        return next((w for w in walk if accept(w)), None)

    def _ring_for(self, workers: Sequence[WorkerLoad]) -> HashRing:
        if isinstance(workers, LoadBook):  # the same ids object until membership changes: O(1) to check
            ids = workers.ids
            if self._ring is not None and self._ring.worker_ids is ids:
                return self._ring
        else:
            ids = frozenset(w.worker_id for w in workers)
        if self._ring is None or self._ring.worker_ids != ids:  # membership changed: rebuild (cheap)
            self._ring = HashRing(sorted(ids), self.virtual_nodes)
        self._ring.worker_ids = ids  # equal: keep the caller's object, so the next check is by identity
        return self._ring

    def check_integrity(self) -> None:
        if self._ring is not None:
            assert self._ring.points == sorted(self._ring.points), "ring points out of order"
            assert set(self._ring.owners) == set(self._ring.worker_ids), "ring owners differ from members"


def _queued(loads: dict[str, WorkerLoad] | LoadBook, worker_id: str) -> int:
    load = loads.get(worker_id)
    assert load is not None, "the ring holds only the workers' ids"
    return load.queued_prompt_tokens
