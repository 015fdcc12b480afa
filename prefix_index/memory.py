"""The in-process prefix index: one router, fed by pulling each prefill worker's KV events over Ray.

Two maps kept in step: block hash → holders (for lookups) and worker → its epoch, cursor, lease
deadline and held hashes (for epoch drops, snapshots and expiry without scanning every block).
Holders are a bitmask of worker slots, not a set: a lookup is a chain of ANDs, and an int costs a
tenth of a set's memory and is invisible to the garbage collector (200k sets made full collections
in the router's process cost milliseconds). The index claims a worker's slot while it holds the worker
(`prefix_index/worker_slots.py`), so a forgotten worker's slot is reused once its bits are gone and no
book sharing the registry still holds it.
The host tier has its own pair of maps (`host` sets, `_host_holders` masks), empty unless workers
publish host-tier events, so lookups of an index without them cost what they did.
Expired workers are reaped at the start of every call, so a dead worker's memory is freed on the
next call after its lease and lookups never see it. Lease deadlines use an injectable monotonic
clock (tests advance a fake one instead of sleeping).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from common.kv_events import KVEventBatch
from engine.block_hash import BlockHash
from engine.block_pool import MEDIUM_HOST, BlockStored, IntegrityError
from prefix_index.base import (
    HolderLevels,
    PrefixIndex,
    PrefixMatch,
    check_batch,
    check_hashes,
    check_worker,
    sort_matches,
)
from prefix_index.worker_slots import CountedSlots, WorkerSlots


@dataclass
class _Worker:
    slot: int  # this worker's bit in the holder masks
    epoch: int
    last_seq: int
    deadline_s: float
    blocks: set[BlockHash] = field(default_factory=set)
    host: set[BlockHash] = field(default_factory=set)  # what its host tier holds (pool blocks too, often)


class InProcessPrefixIndex(PrefixIndex):
    """Not thread-safe: no method awaits, so each call is atomic on the one event loop that owns it."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic, slots: WorkerSlots | None = None):
        """`slots`: the registry of the holder masks' bits (`slots` below), which a `LoadBook` may share so
        its masks line up with the holder levels'; by default a `CountedSlots` of the index's own, a slot
        freed when its worker is forgotten and no sharer holds it."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.lease_s = lease_s
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._holders: dict[BlockHash, int] = {}  # bit `slot` set: that worker holds the block
        self._host_holders: dict[BlockHash, int] = {}  # bit `slot` set: that worker's host tier holds it
        self.slots: WorkerSlots = slots if slots is not None else CountedSlots()
        self._earliest_deadline_s = math.inf  # no worker's deadline is earlier (see _reap)

    async def apply(self, batch: KVEventBatch) -> None:
        check_batch(batch)
        self._reap()
        worker = self._workers.get(batch.worker_id)
        if worker is not None and worker.epoch > batch.epoch:
            return  # a batch from before the worker's restart
        if worker is not None and worker.epoch < batch.epoch:
            self._forget(batch.worker_id)
            worker = None
        base_seq = worker.last_seq if worker is not None else 0
        if batch.last_seq < base_seq:
            return  # older than what was applied: nothing in it is news
        if batch.snapshot is not None:
            worker = self._replace(batch.worker_id, batch.epoch, batch.snapshot, batch.host_snapshot)
        else:
            first_new = next((seq for seq, _ in batch.events if seq > base_seq), batch.last_seq + 1)
            if first_new != base_seq + 1:
                return  # a gap: the puller resumes from cursor() (or a snapshot) instead
            if worker is None:
                worker = self._register(batch.worker_id, batch.epoch)
            for seq, event in batch.events:
                if seq > base_seq:
                    self._apply_event(worker, event)
        worker.last_seq = batch.last_seq
        self._extend(worker)

    async def heartbeat(self, worker_id: str, epoch: int) -> None:
        check_worker(worker_id, epoch)
        self._reap()
        worker = self._workers.get(worker_id)
        if worker is None or worker.epoch > epoch:
            return
        if worker.epoch < epoch:
            self._forget(worker_id)  # restarted: its old blocks are gone; its next batch re-registers it
            return
        self._extend(worker)

    async def match(self, block_hashes: Sequence[BlockHash]) -> list[PrefixMatch]:
        check_hashes(block_hashes)
        self._reap()
        if not block_hashes:
            return []
        counts: dict[str, int] = {}
        following = self._holders.get(block_hashes[0], 0)
        for position, block_hash in enumerate(block_hashes):
            still = following & self._holders.get(block_hash, 0)
            if still != following:
                counts.update(dict.fromkeys(self._owners(following & ~still), position))
                following = still
                if not following:
                    break
        counts.update(dict.fromkeys(self._owners(following), len(block_hashes)))
        if not self._host_holders:
            return sort_matches(counts)
        reach = {w: n for n, mask in self._reach_levels(block_hashes) for w in self._owners(mask)}
        return sort_matches(counts, {w: n - counts.get(w, 0) for w, n in reach.items() if n > counts.get(w, 0)})

    async def holder_levels(self, block_hashes: Sequence[BlockHash]) -> HolderLevels:
        """The chain of ANDs of `match`, kept as one holder mask per depth: nothing is listed until asked."""
        check_hashes(block_hashes)
        self._reap()
        levels = _MaskLevels(_exact_levels(map(self._holders.get, block_hashes, itertools.repeat(0))), self)
        if self._host_holders:
            levels.host = self._host_extended(levels, self._reach_levels(block_hashes))
        return levels

    def _reach_levels(self, block_hashes: Sequence[BlockHash]) -> list[tuple[int, int]]:
        """(n, mask of the workers whose pool or host tier holds exactly the first n blocks), deepest first."""
        pool, host = self._holders, self._host_holders
        return _exact_levels(pool.get(h, 0) | host.get(h, 0) for h in block_hashes)

    def _host_extended(self, levels: _MaskLevels, reach: list[tuple[int, int]]) -> list[PrefixMatch]:
        """The workers whose reach passes their pool run: at each reach level, those whose pool holds less."""
        out: list[PrefixMatch] = []
        for depth, mask in reach:
            for worker_id in self._owners(mask & ~levels.holding_at_least(depth)):
                blocks = levels.blocks_of(worker_id)
                out.append(PrefixMatch(worker_id, blocks, depth - blocks))
        return out

    async def num_entries(self) -> int:
        self._reap()
        return sum(len(worker.blocks) + len(worker.host) for worker in self._workers.values())

    async def remove_worker(self, worker_id: str) -> None:
        self._forget(worker_id)

    async def cursor(self, worker_id: str) -> tuple[int, int] | None:
        self._reap()
        worker = self._workers.get(worker_id)
        return None if worker is None else (worker.epoch, worker.last_seq)

    async def check_integrity(self) -> None:
        for worker_id, worker in self._workers.items():
            _require(self.slots.get(worker_id) == worker.slot, f"{worker_id}'s slot disagrees with the registry")
        if isinstance(self.slots, CountedSlots):  # exactly its workers' slots are claimed for it, none leaked
            try:
                self.slots.check_integrity()
            except AssertionError as err:
                raise IntegrityError(f"worker slots: {err}") from None
            claimed = self.slots.claimed_by(self)
            _require(claimed == set(self._workers), f"claims {sorted(claimed)} != workers {sorted(self._workers)}")
        for worker_id, worker in self._workers.items():
            _require(worker.last_seq >= 0, f"{worker_id} has cursor {worker.last_seq}")
            for block_hash in worker.blocks:
                _require(
                    bool(self._holders.get(block_hash, 0) >> worker.slot & 1),
                    f"{worker_id} holds {block_hash.hex()} but is not among its holders",
                )
            for block_hash in worker.host:
                _require(
                    bool(self._host_holders.get(block_hash, 0) >> worker.slot & 1),
                    f"{worker_id}'s host tier holds {block_hash.hex()} but is not among its host holders",
                )
        for holders, medium in ((self._holders, "pool"), (self._host_holders, "host tier")):
            for block_hash, mask in holders.items():
                _require(mask > 0, f"{block_hash.hex()} has an empty {medium} holder mask (a leak)")
                for worker_id in self._owners(mask):
                    worker = self._workers[worker_id]
                    held = worker.blocks if holders is self._holders else worker.host
                    _require(
                        block_hash in held, f"{block_hash.hex()} lists {worker_id}, whose {medium} does not hold it"
                    )

    async def close(self) -> None:
        for worker_id in self._workers:
            self.slots.unclaim(worker_id, self)
        self._workers.clear()
        self._holders.clear()
        self._host_holders.clear()

    def _owners(self, mask: int) -> list[str]:
        try:
            return self.slots.owners_of(mask)
        except KeyError as err:
            raise IntegrityError(f"holder bit {err.args[0]} has no worker") from None

    def _register(self, worker_id: str, epoch: int) -> _Worker:
        worker = self._workers[worker_id] = _Worker(self.slots.claim(worker_id, self), epoch, 0, 0.0)
        return worker

    def _apply_event(self, worker: _Worker, event) -> None:
        bit = 1 << worker.slot
        on_host = event.medium == MEDIUM_HOST
        held, holders = (worker.host, self._host_holders) if on_host else (worker.blocks, self._holders)
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                held.add(block_hash)
                holders[block_hash] = holders.get(block_hash, 0) | bit
        else:
            for block_hash in event.block_hashes:
                if block_hash in held:
                    held.discard(block_hash)
                    _drop_bit(holders, block_hash, bit)

    def _replace(
        self, worker_id: str, epoch: int, snapshot: Sequence[BlockHash], host_snapshot: Sequence[BlockHash] = ()
    ) -> _Worker:
        self._forget(worker_id)
        worker = self._register(worker_id, epoch)
        worker.blocks, worker.host = set(snapshot), set(host_snapshot)
        bit = 1 << worker.slot
        for held, holders in ((worker.blocks, self._holders), (worker.host, self._host_holders)):
            for block_hash in held:
                holders[block_hash] = holders.get(block_hash, 0) | bit
        return worker

    def _forget(self, worker_id: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            bit = 1 << worker.slot
            for block_hash in worker.blocks:
                _drop_bit(self._holders, block_hash, bit)
            for block_hash in worker.host:
                _drop_bit(self._host_holders, block_hash, bit)
            self.slots.unclaim(worker_id, self)  # none of its bits is left here

    def _extend(self, worker: _Worker) -> None:
        worker.deadline_s = self._clock() + self.lease_s
        self._earliest_deadline_s = min(self._earliest_deadline_s, worker.deadline_s)

    def _reap(self) -> None:
        # `_earliest_deadline_s` bounds every deadline from below (each new deadline lowers it if earlier;
        # refreshed ones only move later): until the clock passes it nobody can have expired, and calls
        # skip the scan over all workers.
        now_s = self._clock()
        if now_s < self._earliest_deadline_s:
            return
        for worker_id in [w for w, state in self._workers.items() if state.deadline_s <= now_s]:
            self._forget(worker_id)
        self._earliest_deadline_s = min((w.deadline_s for w in self._workers.values()), default=math.inf)


def _drop_bit(holders: dict[BlockHash, int], block_hash: BlockHash, bit: int) -> None:
    mask = holders.get(block_hash, 0) & ~bit
    if mask:
        holders[block_hash] = mask
    else:  # empty masks would pile up for every block ever seen
        holders.pop(block_hash, None)


def _exact_levels(masks: Iterable[int]) -> list[tuple[int, int]]:
    """(n, mask of the workers holding exactly the first n blocks), deepest first, from each block's holder
    mask in chain order: the chain of ANDs, a level wherever it drops holders."""
    exact: list[tuple[int, int]] = []
    chain = iter(masks)
    following = next(chain, 0)  # holders of every block so far
    depth = 1
    for mask in chain:
        if not following:
            break
        still = following & mask
        if still != following:
            exact.append((depth, following & ~still))
            following = still
        depth += 1
    if following:
        exact.append((depth, following))
    exact.reverse()
    return exact


class _MaskLevels(HolderLevels):
    """Holder levels as the index's slot masks; `blocks_of` bisects the cumulative masks (holders of at
    least each depth, growing as depth falls)."""

    def __init__(self, exact: list[tuple[int, int]], index: InProcessPrefixIndex):
        self._depths = [depth for depth, _ in exact]
        self._exact = dict(exact)
        self._index = index
        self.slots = index.slots
        self.host: Sequence[PrefixMatch] = ()  # set by the index when some worker publishes its host tier
        self._at_least: list[int] = []
        union = 0
        for _, mask in exact:
            union |= mask
            self._at_least.append(union)

    @property
    def depths(self) -> Sequence[int]:
        return self._depths

    def count(self, num_blocks: int) -> int:
        return self._exact.get(num_blocks, 0).bit_count()

    def members(self, num_blocks: int) -> list[str]:
        return self._index._owners(self._exact.get(num_blocks, 0))

    def exact_mask(self, num_blocks: int) -> int:
        return self._exact.get(num_blocks, 0)

    def host_extended(self) -> Sequence[PrefixMatch]:
        return self.host

    def holding_at_least(self, num_blocks: int) -> int:
        """The mask of the workers whose pool holds at least `num_blocks` leading blocks."""
        mask = 0
        for depth, at_least in zip(self._depths, self._at_least, strict=True):
            if depth < num_blocks:
                break
            mask = at_least
        return mask

    def blocks_of(self, worker_id: str) -> int:
        worker = self._index._workers.get(worker_id)
        if worker is None or not self._at_least or not self._at_least[-1] >> worker.slot & 1:
            return 0
        low, high = 0, len(self._at_least) - 1  # the first cumulative mask holding the bit
        while low < high:
            middle = (low + high) // 2
            if self._at_least[middle] >> worker.slot & 1:
                high = middle
            else:
                low = middle + 1
        return self._depths[low]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)
