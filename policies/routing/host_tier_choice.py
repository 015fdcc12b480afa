"""`cache_aware`'s third option: a worker whose own host tier holds the blocks after its pool's prefix
fetches them back instead of computing them (the pool evicted them; the tier kept them).

For a worker holding n leading blocks in its pool and h more in its host tier (`PrefixMatch`), the cost
of that option is

cost(worker) = queued + host_fetch_tokens(worker, h) + uncached(n + h)

where `uncached(k)` is what a worker holding k blocks spends otherwise (computing the rest, or fetching
what the shared store adds: `cache_aware.uncached_cost`) and `host_fetch_tokens` prices the fetch at
the worker's own measured host-tier read bandwidth (policies/host_fetch_cost.py). A worker's cost is the
least of its options, so the fleet's least cost is the least of the walk's (pool and store only) and
this one's over the few workers whose host tier extends their pool run (`HolderLevels.host_extended`):
scoring those alone is exact. Ties with the walk's choice keep the walk's (no fetch); ties among these go
to the longer run, then to ring order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

from policies.routing.base import RouteQuery
from prefix_index.base import PrefixMatch


class HostTierLocation(Protocol):
    """The prefill workers' host tiers as places a prompt's blocks can be: what fetching costs."""

    def fetch_tokens(self, worker_id: str, num_blocks: int) -> int:
        """A fetch of `num_blocks` blocks from the worker's host tier, in prefill tokens (0 for none)."""


class HostFetch(NamedTuple):
    worker_id: str
    cost: int  # queued tokens + the fetch + what is left to compute or fetch from the store, in tokens
    pool_blocks: int  # leading blocks in its pool
    host_blocks: int  # the blocks after them it fetches from its host tier


def best_host_fetch(
    query: RouteQuery,
    extended: Sequence[PrefixMatch],
    queued_of: Callable[[str], int | None],
    uncached_of: Callable[[int], int],
    host: HostTierLocation,
    first_in_ring: Callable[[Iterable[str]], str],
) -> HostFetch | None:
    """The least-cost worker among `extended` for whom fetching from its host tier beats its other
    options, or None. `queued_of(worker)`: its queued tokens (None: not routable now)."""
    usable_blocks = (query.num_prompt_tokens - 1) // query.block_size  # the last token is always computed
    best: tuple[int, int] | None = None  # (cost, -blocks served without computing)
    tied: dict[str, HostFetch] = {}
    for match in extended:
        queued = queued_of(match.worker_id)
        fetched = min(match.num_host_blocks, usable_blocks - match.num_blocks)
        if queued is None or fetched <= 0:
            continue
        own = uncached_of(match.num_blocks)
        with_fetch = host.fetch_tokens(match.worker_id, fetched) + uncached_of(match.num_blocks + fetched)
        if with_fetch >= own:
            continue  # its other options cost no more: the walk scored it already
        key = (queued + with_fetch, -(match.num_blocks + fetched))
        if best is None or key < best:
            best, tied = key, {}
        if key == best:
            tied[match.worker_id] = HostFetch(match.worker_id, key[0], match.num_blocks, fetched)
    return tied[first_in_ring(tied)] if tied else None
