"""The routing-policy interface: which prefill worker computes a prompt.

Contract (every implementation; tests/policies/test_routing_contract.py runs each against it):
* `choose(query, workers)` returns a `RouteDecision` naming one of `workers` (never another id), for
  any non-empty `workers`; it raises `NoWorkersError` for an empty one. It never blocks on anything
  but its own index lookup, and it never raises because an index is unreachable (it degrades).
* It is deterministic given the same inputs and internal state (no wall-clock randomness), so tests
  can assert exact choices.
* Policies are owned by one router and used from its event loop only: no locking.
* `check_integrity()` raises AssertionError on inconsistent internal state.
Load figures are the router's own live view (requests it has in flight on each worker and the
uncached prompt tokens it sent there that were not prefilled yet).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

from engine.block_hash import BlockHash
from prefix_index.worker_slots import WorkerSlots


class NoWorkersError(RuntimeError):
    """No healthy worker to route to."""


class WorkerLoad(NamedTuple):
    worker_id: str
    inflight_requests: int
    queued_prompt_tokens: int  # uncached prompt tokens routed there, not yet prefilled


class RouteQuery(NamedTuple):
    block_hashes: tuple[BlockHash, ...]  # chained hashes of the prompt's full blocks
    num_prompt_tokens: int
    block_size: int
    prompt_key: bytes  # stable bytes standing for the prompt when it has no full block


class RouteDecision(NamedTuple):
    worker_id: str
    expected_cached_blocks: int  # leading blocks the policy believes the worker holds (0 if unknown)
    # The worker the index says holds the most leading blocks of the prompt, and how many (None / 0
    # when the policy has no index): the chosen worker may pull the difference from it.
    holder_id: str | None = None
    holder_blocks: int = 0
    # Blocks after `expected_cached_blocks` the policy expects the worker to fetch from the shared KV
    # store rather than compute (0 when the store holds no more, or fetching costs more).
    store_blocks: int = 0
    # Blocks after `expected_cached_blocks` the policy expects the worker to fetch from its own host tier
    # (the pool evicted them); `store_blocks` then count after these.
    host_blocks: int = 0


class RoutingPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    async def choose(self, query: RouteQuery, workers: Sequence[WorkerLoad]) -> RouteDecision:
        """One worker of `workers` for this prompt (see the module contract)."""

    def locate_store(self, store) -> None:  # noqa: B027 - a default on purpose: most policies price no fetch
        """Gives the policy the shared KV store as a location (`cache_aware.StoreLocation`); policies that
        do not price fetches from it ignore it."""

    def locate_host_tier(self, host) -> None:  # noqa: B027 - a default on purpose: most policies price no fetch
        """Gives the policy the workers' host tiers as a location (`host_tier_choice.HostTierLocation`);
        policies that do not price fetches from them ignore it."""

    def holder_slots(self) -> WorkerSlots | None:
        """The worker slots of the holder masks this policy reads (its in-process index's), for a caller's
        `LoadBook` to share so the policy meets holders with masks; None: the policy reads no masks."""
        return None

    def check_integrity(self) -> None:  # noqa: B027 - a default on purpose: stateless policies override nothing
        """Raises AssertionError if internal state is inconsistent; stateless policies have none."""


def require_workers(workers: Sequence[WorkerLoad]) -> None:
    if not workers:
        raise NoWorkersError("no healthy prefill worker to route to")


def least_loaded(workers: Sequence[WorkerLoad]) -> WorkerLoad:
    """Fewest queued prompt tokens, then fewest requests, then the smallest id (deterministic)."""
    return min(workers, key=lambda w: (w.queued_prompt_tokens, w.inflight_requests, w.worker_id))
