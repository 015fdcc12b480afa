"""The global prefix index: which prefill worker holds which leading blocks of a prompt.

Workers emit numbered KV events (`common.kv_events.KVEventBatch`); something applies them to an
index — the router's puller (in-process index, one router) or each worker's publisher (Redis index,
any number of routers) — and the router asks `match(block_hashes)` to pick a worker by prefix.

Apply rules, shared by every implementation (the contract test checks them all):

* A worker's entries belong to one *epoch* (one start of the worker). A batch or heartbeat of a
  newer epoch means the worker restarted: everything of its older epoch is dropped first. A batch of
  an older epoch is ignored.
* Within an epoch the index keeps a *cursor*, the last sequence number applied. Events at or before
  it are skipped, so re-applying a batch (or an older one) changes no entry. A batch that would leave
  a gap (its first new event is not cursor + 1; an unknown worker counts as cursor 0) is ignored:
  `cursor()` tells the puller where to resume, and a puller with no cursor asks for a snapshot.
* A snapshot replaces the worker's entries with exactly the hashes it lists.
* A worker's entries live `lease_s` after its last applied batch or heartbeat; after that the worker
  is unknown (no matches, no cursor) and its memory is reclaimed.
* Tiers: each entry is of a medium (`BlockStored.medium`): the worker's pool, or its host tier (blocks
  the pool evicted stay there until the tier evicts them). The two are independent sets per worker;
  a snapshot replaces both (`KVEventBatch.host_snapshot`). A match counts `num_blocks`, the leading
  blocks in the pool, then `num_host_blocks`, how far the chain continues with blocks in the pool or
  the host tier: what the worker serves from its pool, then fetches from its host tier.

Tenants: the engine's `BlockStored` events carry no tenant, so the index cannot key entries by one.
Isolation comes from the hash spec instead: a block hash is chained from a root salted with the
tenant (`engine.block_hash.HashNamespace`), so a query hashed for tenant A can only equal a block
cached for tenant B by a 128-bit collision, and a worker verifies tokens on every local hit anyway.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from common.kv_events import KVEventBatch
from engine.block_hash import BLOCK_HASH_BYTES, BlockHash, spec_fingerprint
from engine.block_pool import MEDIA, BlockRemoved, BlockStored
from prefix_index.worker_slots import WorkerSlots

KEY_SCHEMA_VERSION = 1  # bump when the Redis key layout changes; old and new never share keys


class PrefixIndexUnavailable(RuntimeError):
    """The index could not answer in time (e.g. Redis down or hung); callers fall back, never hang."""


class PrefixMatch(NamedTuple):
    worker_id: str
    num_blocks: int  # leading blocks of the query this worker holds in its pool (contiguous from block 0)
    num_host_blocks: int = 0  # the blocks after those its host tier holds (contiguous): a fetch away


@dataclass(frozen=True)
class IndexNamespace:
    """What must agree for two processes to share index entries: model, block size, hash spec.

    Caches of different models, block sizes or hash-spec versions live under different keys, so a
    misconfigured worker can never feed a router wrong hits; it simply contributes none.
    """

    model_identity: str
    block_size: int
    hash_spec: str = field(default_factory=spec_fingerprint)

    def __post_init__(self):
        if not isinstance(self.model_identity, str) or not self.model_identity:
            raise ValueError("model_identity must be a non-empty string")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.hash_spec, str) or not self.hash_spec:
            raise ValueError("hash_spec must be a non-empty string")

    def key_prefix(self) -> str:
        """Prefix of every Redis key of this namespace.

        The identity is digested (model names may hold any character) and wrapped in a hash tag:
        all keys of a namespace share one slot, as the standalone index's multi-key scripts need. The
        Redis Cluster index (redis_cluster_index.py) keys by block instead, to spread over the shards.
        """
        raw = "\0".join((self.model_identity, str(self.block_size), self.hash_spec)).encode("utf-8")
        digest = hashlib.blake2b(raw, digest_size=10).hexdigest()
        return f"splitserve:pi:v{KEY_SCHEMA_VERSION}:{{{digest}}}"


class HolderLevels(ABC):
    """The holders of a prompt's leading blocks grouped by depth: what `match` says, without listing it.

    A hot prefix (a system prompt every worker caches) makes `match` list the whole fleet; a policy that
    walks depths from the deepest and stops early (policies/routing/cache_aware.py) reads only the few
    deep holders and asks about single workers. Valid until the index next changes: read it at once.
    """

    @property
    @abstractmethod
    def depths(self) -> Sequence[int]:
        """The distinct numbers of leading blocks (>= 1) some live worker holds, deepest first."""

    @abstractmethod
    def count(self, num_blocks: int) -> int:
        """How many workers hold exactly `num_blocks` leading blocks (`num_blocks` in `depths`)."""

    @abstractmethod
    def members(self, num_blocks: int) -> list[str]:
        """The workers holding exactly `num_blocks` leading blocks (any order)."""

    @abstractmethod
    def blocks_of(self, worker_id: str) -> int:
        """How many leading blocks the worker holds in its pool (0 when none, or unknown)."""

    def host_extended(self) -> Sequence[PrefixMatch]:
        """The workers whose host tier continues the chain past their pool (`num_host_blocks` >= 1), any
        order: the only ones a host-tier fetch could serve more of the prompt. Depths and members above
        count pool blocks only."""
        return ()

    # Levels kept as masks of worker slots (the in-process index's) set `slots` and answer these two;
    # a policy whose LoadBook shares those slots then meets members with ANDs instead of one by one.
    slots: WorkerSlots | None = None

    def exact_mask(self, num_blocks: int) -> int:
        """The mask (in `slots`' bits) of the workers holding exactly `num_blocks` leading blocks."""
        raise NotImplementedError("levels without slots have no masks")

    def holding_at_least(self, num_blocks: int) -> int:
        """The mask (in `slots`' bits) of the workers holding at least `num_blocks` leading blocks."""
        raise NotImplementedError("levels without slots have no masks")


class MatchLevels(HolderLevels):
    """Holder levels built from a `match` list (indexes without a cheaper structure)."""

    def __init__(self, matches: Sequence[PrefixMatch]):
        self._blocks = {m.worker_id: m.num_blocks for m in matches if m.num_blocks}
        self._by_depth: dict[int, list[str]] = {}
        for m in matches:
            if m.num_blocks:
                self._by_depth.setdefault(m.num_blocks, []).append(m.worker_id)
        self._depths = sorted(self._by_depth, reverse=True)
        self._host = [m for m in matches if m.num_host_blocks > 0]

    @property
    def depths(self) -> Sequence[int]:
        return self._depths

    def count(self, num_blocks: int) -> int:
        return len(self._by_depth.get(num_blocks, ()))

    def members(self, num_blocks: int) -> list[str]:
        return list(self._by_depth.get(num_blocks, ()))

    def blocks_of(self, worker_id: str) -> int:
        return self._blocks.get(worker_id, 0)

    def host_extended(self) -> Sequence[PrefixMatch]:
        return self._host


class PrefixIndex(ABC):
    """Block hash → the live workers caching it; answers "who holds the longest prefix of this prompt".

    Ownership: an index owns only its own view (memory, or its Redis connections); workers own their
    caches, and the index is a hint that may lag them by one publish interval. Async safety: every
    method may be called concurrently from coroutines of the one event loop the index is used on; an
    index is not shared across event loops or threads. All methods follow the module's apply rules.
    """

    # An index whose holder levels are masks of worker slots (in-process) names its registry here: a
    # caller's LoadBook given the same one lines its masks up with the levels' (None: no masks).
    slots: WorkerSlots | None = None

    @abstractmethod
    async def apply(self, batch: KVEventBatch) -> None:
        """Apply one worker's batch; idempotent, epoch- and gap-checked; refreshes the worker's lease."""

    @abstractmethod
    async def heartbeat(self, worker_id: str, epoch: int) -> None:
        """Refresh the lease of a worker known at `epoch`. A newer epoch drops the worker's entries
        (it restarted; its next batch re-registers it); an unknown worker or older epoch is a no-op."""

    @abstractmethod
    async def match(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch]:
        """For each live worker holding block 0 (in its pool or host tier), how many leading blocks its
        pool holds and how many more its host tier continues with (see the module's tier rule).

        Sorted by num_blocks descending, then num_host_blocks descending, then worker_id. Empty when
        nobody holds block 0. A caller that ignores tiers reads `num_blocks` (0 for host-only holders).
        Raises PrefixIndexUnavailable when a remote index cannot answer in time.
        """

    async def holder_levels(self, block_hashes: Sequence[BlockHash]) -> HolderLevels:
        """`match`'s answer grouped by depth (same holders, same counts); indexes override it when they
        can answer without listing every holder. Raises what `match` raises."""
        return MatchLevels(await self.match(block_hashes))

    @abstractmethod
    async def num_entries(self) -> int:
        """(worker, block hash) entries of live workers, pool and host tier counted apart: what
        GetClusterStatus reports as index size."""

    @abstractmethod
    async def remove_worker(self, worker_id: str) -> None:
        """Forget the worker and all its entries now (it left the cluster); unknown ids are a no-op."""

    @abstractmethod
    async def cursor(self, worker_id: str) -> tuple[int, int] | None:
        """(epoch, last_seq) applied for a live worker, None when unknown or expired: resume from it."""

    @abstractmethod
    async def check_integrity(self) -> None:
        """Raise engine.block_pool.IntegrityError naming the first inconsistency (tests call it)."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections; the index is unusable afterwards."""


def check_worker(worker_id: str, epoch: int) -> None:
    """Worker ids are non-empty strings; epochs non-negative integers (Redis compares them as text)."""
    if not isinstance(worker_id, str) or not worker_id or "\0" in worker_id:
        raise ValueError(f"worker_id must be a non-empty string without NUL, got {worker_id!r}")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")


def check_batch(batch: KVEventBatch) -> None:
    """Reject malformed batches before they touch any index (a bug upstream, never data to store)."""
    check_worker(batch.worker_id, batch.epoch)
    if not isinstance(batch.last_seq, int) or batch.last_seq < 0:
        raise ValueError(f"last_seq must be an integer >= 0, got {batch.last_seq!r}")
    if batch.snapshot is not None:
        if batch.events:
            raise ValueError("a snapshot batch carries no events")
        check_hashes(batch.snapshot)
        check_hashes(batch.host_snapshot)
        return
    if batch.host_snapshot:
        raise ValueError("host_snapshot comes only with a snapshot")
    seqs = [seq for seq, _ in batch.events]
    if seqs and (seqs != list(range(seqs[0], seqs[0] + len(seqs))) or seqs[-1] != batch.last_seq):
        raise ValueError(f"events of {batch.worker_id} must be numbered contiguously up to last_seq")
    for _, event in batch.events:
        if not isinstance(event, (BlockStored, BlockRemoved)):
            raise ValueError(f"unknown KV event type {type(event).__name__}")
        if event.medium not in MEDIA:
            raise ValueError(f"KV event medium must be one of {', '.join(MEDIA)}, got {event.medium!r}")
        check_hashes(event.block_hashes)


def check_hashes(block_hashes: Sequence[BlockHash]) -> None:
    for block_hash in block_hashes:
        if not isinstance(block_hash, bytes) or len(block_hash) != BLOCK_HASH_BYTES:
            raise ValueError(f"a block hash is {BLOCK_HASH_BYTES} raw bytes, got {block_hash!r}")


def sort_matches(counts: dict[str, int], host_counts: dict[str, int] | None = None) -> list[PrefixMatch]:
    """Matches with at least one block in pool or host tier, in the interface's order. `host_counts`:
    worker → blocks its host tier continues with past its pool run (absent: none)."""
    host_counts = host_counts or {}
    matches = [PrefixMatch(w, counts.get(w, 0), host_counts.get(w, 0)) for w in counts.keys() | host_counts.keys()]
    return sorted(
        (m for m in matches if m.num_blocks > 0 or m.num_host_blocks > 0),
        key=lambda m: (-m.num_blocks, -m.num_host_blocks, m.worker_id),
    )
