"""The in-process prefix index: one router, fed by pulling each prefill worker's KV events over Ray.

Two maps kept in step: block hash → holders (for lookups) and worker → its epoch, cursor, lease
deadline and held hashes (for epoch drops, snapshots and expiry without scanning every block).
Holders are a bitmask of worker slots, not a set: a lookup is a chain of ANDs, and an int costs a
tenth of a set's memory and is invisible to the garbage collector (200k sets made full collections
in the router's process cost milliseconds). A forgotten worker's slot is reused once its bits are gone.
Expired workers are reaped at the start of every call, so a dead worker's memory is freed on the
next call after its lease and lookups never see it. Lease deadlines use an injectable monotonic
clock (tests advance a fake one instead of sleeping).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.kv_events import KVEventBatch
from engine.block_hash import BlockHash
from engine.block_pool import BlockStored, IntegrityError
from prefix_index.base import (
    HolderLevels,
    PrefixIndex,
    PrefixMatch,
    check_batch,
    check_hashes,
    check_worker,
    sort_matches,
)


@dataclass
class _Worker:
    slot: int  # this worker's bit in the holder masks
    epoch: int
    last_seq: int
    deadline_s: float
    blocks: set[BlockHash] = field(default_factory=set)


class InProcessPrefixIndex(PrefixIndex):
    """Not thread-safe: no method awaits, so each call is atomic on the one event loop that owns it."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.lease_s = lease_s
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._holders: dict[BlockHash, int] = {}  # bit `slot` set: that worker holds the block
        self._slot_owner: dict[int, str] = {}
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
            worker = self._replace(batch.worker_id, batch.epoch, batch.snapshot)
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
        return sort_matches(counts)

    async def holder_levels(self, block_hashes: Sequence[BlockHash]) -> HolderLevels:
        """The chain of ANDs of `match`, kept as one holder mask per depth: nothing is listed until asked."""
        check_hashes(block_hashes)
        self._reap()
        exact: list[tuple[int, int]] = []  # (depth, mask of the workers holding exactly that many blocks)
        following = self._holders.get(block_hashes[0], 0) if block_hashes else 0
        for position, block_hash in enumerate(block_hashes):
            if not following:
                break
            still = following & self._holders.get(block_hash, 0)
            if still != following:
                exact.append((position, following & ~still))
                following = still
        if following:
            exact.append((len(block_hashes), following))
        exact.reverse()
        return _MaskLevels(exact, self)

    async def num_entries(self) -> int:
        self._reap()
        return sum(len(worker.blocks) for worker in self._workers.values())

    async def remove_worker(self, worker_id: str) -> None:
        self._forget(worker_id)

    async def cursor(self, worker_id: str) -> tuple[int, int] | None:
        self._reap()
        worker = self._workers.get(worker_id)
        return None if worker is None else (worker.epoch, worker.last_seq)

    async def check_integrity(self) -> None:
        _require(
            self._slot_owner == {w.slot: worker_id for worker_id, w in self._workers.items()},
            "slot owners disagree with the workers' slots",
        )
        for worker_id, worker in self._workers.items():
            _require(worker.last_seq >= 0, f"{worker_id} has cursor {worker.last_seq}")
            for block_hash in worker.blocks:
                _require(
                    bool(self._holders.get(block_hash, 0) >> worker.slot & 1),
                    f"{worker_id} holds {block_hash.hex()} but is not among its holders",
                )
        for block_hash, mask in self._holders.items():
            _require(mask > 0, f"{block_hash.hex()} has an empty holder mask (a leak)")
            for worker_id in self._owners(mask):
                _require(
                    block_hash in self._workers[worker_id].blocks,
                    f"{block_hash.hex()} lists {worker_id}, which does not hold it",
                )

    async def close(self) -> None:
        self._workers.clear()
        self._holders.clear()
        self._slot_owner.clear()

    def _owners(self, mask: int) -> list[str]:
        # A byte at a time (a table lists each byte's set bits): peeling the low bit off a wide mask
        # copies the whole int per holder, which made listing a prefix most of a fleet holds the
        # simulator's hottest call.
        slot_owner = self._slot_owner
        data = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
        try:
            return [
                slot_owner[base + bit]
                for base, byte in zip(range(0, 8 * len(data), 8), data, strict=True)
                if byte
                for bit in _BYTE_BITS[byte]
            ]
        except KeyError as err:
            raise IntegrityError(f"holder bit {err.args[0]} has no worker") from None

    def _register(self, worker_id: str, epoch: int) -> _Worker:
        slot = next(i for i in range(len(self._slot_owner) + 1) if i not in self._slot_owner)
        self._slot_owner[slot] = worker_id
        worker = self._workers[worker_id] = _Worker(slot, epoch, 0, 0.0)
        return worker

    def _apply_event(self, worker: _Worker, event) -> None:
        bit = 1 << worker.slot
        if isinstance(event, BlockStored):
            for block_hash in event.block_hashes:
                worker.blocks.add(block_hash)
                self._holders[block_hash] = self._holders.get(block_hash, 0) | bit
        else:
            for block_hash in event.block_hashes:
                if block_hash in worker.blocks:
                    worker.blocks.discard(block_hash)
                    self._drop_bit(block_hash, bit)

    def _replace(self, worker_id: str, epoch: int, snapshot: Sequence[BlockHash]) -> _Worker:
        self._forget(worker_id)
        worker = self._register(worker_id, epoch)
        worker.blocks = set(snapshot)
        bit = 1 << worker.slot
        for block_hash in worker.blocks:
            self._holders[block_hash] = self._holders.get(block_hash, 0) | bit
        return worker

    def _forget(self, worker_id: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            bit = 1 << worker.slot
            for block_hash in worker.blocks:
                self._drop_bit(block_hash, bit)
            del self._slot_owner[worker.slot]  # reusable: none of its bits is left

    def _drop_bit(self, block_hash: BlockHash, bit: int) -> None:
        mask = self._holders.get(block_hash, 0) & ~bit
        if mask:
            self._holders[block_hash] = mask
        else:  # empty masks would pile up for every block ever seen
            self._holders.pop(block_hash, None)

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


_BYTE_BITS = tuple(tuple(bit for bit in range(8) if byte >> bit & 1) for byte in range(256))  # byte → its set bits


class _MaskLevels(HolderLevels):
    """Holder levels as the index's slot masks; `blocks_of` bisects the cumulative masks (holders of at
    least each depth, growing as depth falls)."""

    def __init__(self, exact: list[tuple[int, int]], index: InProcessPrefixIndex):
        self._depths = [depth for depth, _ in exact]
        self._exact = dict(exact)
        self._index = index
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
