"""`prefix_hash`: consistent hashing of the prompt's leading block hashes onto the workers.

Prompts that share their first `prefix_blocks` blocks land on the same worker, so its prefix cache
serves them. The ring has `virtual_nodes` points per worker, so when a worker joins or leaves only
the keys of the arc it gains or loses move (about 1/N of them), not everything. Load is ignored by
design; `cache_aware` weighs it.
"""
from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from router.routing.base import RouteDecision, RouteQuery, RoutingPolicy, WorkerLoad, require_workers

DEFAULT_PREFIX_BLOCKS = 2
DEFAULT_VIRTUAL_NODES = 128


def ring_point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring over a fixed set of worker ids."""

    def __init__(self, worker_ids: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES):
        points = sorted((ring_point(f"{worker_id}#{i}".encode()), worker_id)
                        for worker_id in worker_ids for i in range(virtual_nodes))
        self.points = [p for p, _ in points]
        self.owners = [w for _, w in points]
        self.worker_ids = frozenset(worker_ids)

    def owner(self, key: bytes) -> str:
        index = bisect.bisect(self.points, ring_point(key)) % len(self.points)
        return self.owners[index]

    def preference(self, key: bytes) -> list[str]:
        """Every worker once, in the order met walking the ring from the key: the owner first, then
        who would own the key if the owner left, and so on. Every router computes the same order."""
        start = bisect.bisect(self.points, ring_point(key))
        order: dict[str, None] = {}
        for offset in range(len(self.owners)):
            order.setdefault(self.owners[(start + offset) % len(self.owners)])
            if len(order) == len(self.worker_ids):
                break
        return list(order)


def prefix_key(query: RouteQuery, prefix_blocks: int) -> bytes:
    """The chained hash of block min(prefix_blocks, n) - 1 covers all blocks before it too."""
    if query.block_hashes:
        return bytes(query.block_hashes[min(prefix_blocks, len(query.block_hashes)) - 1])
    return query.prompt_key


class PrefixHashPolicy(RoutingPolicy):
    name = "prefix_hash"

    def __init__(self, prefix_blocks: int = DEFAULT_PREFIX_BLOCKS, virtual_nodes: int = DEFAULT_VIRTUAL_NODES):
        if prefix_blocks < 1 or virtual_nodes < 1:
            raise ValueError("prefix_blocks and virtual_nodes must be >= 1")
        self.prefix_blocks, self.virtual_nodes = prefix_blocks, virtual_nodes
        self._ring: HashRing | None = None

    async def choose(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> RouteDecision:
        return self.choose_now(query, workers)

    def choose_now(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> RouteDecision:
        """The same choice without awaiting (cache_aware falls back to it from inside its own choose)."""
        require_workers(workers)
        return RouteDecision(self._ring_for(workers).owner(prefix_key(query, self.prefix_blocks)), 0)

    def preference(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> list[str]:
        """The workers in this prompt's ring order (see HashRing.preference)."""
        return self._ring_for(workers).preference(prefix_key(query, self.prefix_blocks))

    def _ring_for(self, workers: Sequence[WorkerLoad]) -> HashRing:
        ids = frozenset(w.worker_id for w in workers)
        if self._ring is None or self._ring.worker_ids != ids:  # membership changed: rebuild (cheap)
            self._ring = HashRing(sorted(ids), self.virtual_nodes)
        return self._ring

    def check_integrity(self) -> None:
        if self._ring is not None:
            assert self._ring.points == sorted(self._ring.points), "ring points out of order"
            assert set(self._ring.owners) == set(self._ring.worker_ids), "ring owners differ from members"
