"""`LoadBook`: the routable workers' loads, kept in load order as they change.

A routing policy given a plain list of `WorkerLoad`s has to look at every entry to find the least
loaded one. A caller that keeps a `LoadBook` instead (the simulator does; it changes one worker per
booking) lets the policies find the least loaded workers, and walk them in load order, without a scan:
workers sit in buckets keyed by (queued prompt tokens, requests in flight), ids sorted within a bucket,
and the bucket keys in one sorted list. An update moves one id between two buckets (a bisection and
a list insert: a memmove, no Python loop over the fleet).

It is a `Sequence[WorkerLoad]` too, so every policy accepts it where it accepts a list; the list view
is rebuilt only when something indexes it. `ids` and `version` change only when membership does, so a
policy can cache what it derives from membership (the `prefix_hash` ring) and check it in O(1).
Given the `WorkerSlots` of an in-process prefix index, the book also keeps, per queue length, the mask
of the workers at that length in the index's bit positions (`masks_ascending`), so a policy can meet
a holder level's least queued member, or a tie, with ANDs of masks (policies/routing/cache_aware.py).
It claims each worker's slot while the worker is in the book, so a shared `CountedSlots` never gives
that slot to another worker before the book lets it go.
Not thread-safe: owned by one router's (or the simulator's) event loop, as the policies are.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from policies.routing.base import WorkerLoad
from prefix_index.worker_slots import CountedSlots, WorkerSlots

_Key = tuple[int, int]  # (queued prompt tokens, requests in flight)


class LoadBook(Sequence[WorkerLoad]):
    def __init__(self, loads: Iterable[WorkerLoad] = (), slots: WorkerSlots | None = None):
        self.slots = slots
        self._queued_masks: dict[int, int] = {}  # with slots: queued tokens → mask of the workers at it
        self._queued_values: list[int] = []  # with slots: the keys of _queued_masks, ascending
        self.mask = 0  # with slots: every worker's bit
        self._bits: dict[str, int] = {}  # with slots: worker id → 1 << its slot
        self._bits_releases = 0 if slots is None else slots.releases
        self._loads: dict[str, WorkerLoad] = {}
        self._buckets: dict[_Key, list[str]] = {}  # ids sorted
        self._keys: list[_Key] = []  # sorted keys of the non-empty buckets
        self.total_queued = 0  # queued prompt tokens over every worker (prefix_hash's load bound reads it)
        self.version = 0  # bumped when a worker joins or leaves
        self._ids: frozenset[str] | None = frozenset()
        self._list: list[WorkerLoad] | None = []
        for load in loads:
            self.set(load)

    # ---- changes ----------------------------------------------------------------------------------
    def set(self, load: WorkerLoad) -> None:
        """Adds the worker or updates its load."""
        old = self._loads.get(load.worker_id)
        if old is not None:
            if old == load:
                return
            self._unfile(old)
            if self.slots is not None:
                self._refile_bit(load.worker_id, old.queued_prompt_tokens, load.queued_prompt_tokens)
        else:
            if self.slots is not None:
                self.slots.claim(load.worker_id, self)  # its bit is ours until it leaves the book
                self._refile_bit(load.worker_id, None, load.queued_prompt_tokens)
            self.version += 1
            self._ids = None
        self._loads[load.worker_id] = load
        self.total_queued += load.queued_prompt_tokens
        key = (load.queued_prompt_tokens, load.inflight_requests)
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = [load.worker_id]
            bisect.insort(self._keys, key)
        else:
            bisect.insort(bucket, load.worker_id)
        self._list = None

    def remove(self, worker_id: str) -> None:
        """Drops the worker (it left, or stopped serving); an unknown id is a no-op."""
        old = self._loads.pop(worker_id, None)
        if old is None:
            return
        self._unfile(old)
        if self.slots is not None:
            self._refile_bit(worker_id, old.queued_prompt_tokens, None)
            self.slots.unclaim(worker_id, self)  # its slot is retired once the index lets it go too
        self.version += 1
        self._ids = None
        self._list = None

    def _unfile(self, load: WorkerLoad) -> None:
        self.total_queued -= load.queued_prompt_tokens
        key = (load.queued_prompt_tokens, load.inflight_requests)
        bucket = self._buckets[key]
        del bucket[bisect.bisect_left(bucket, load.worker_id)]
        if not bucket:
            del self._buckets[key]
            del self._keys[bisect.bisect_left(self._keys, key)]

    def _refile_bit(self, worker_id: str, old_queued: int | None, new_queued: int | None) -> None:
        """Moves the worker's bit between queue masks (None: not in the book). A change of requests alone
        moves nothing, and the fleet's mask changes only when a worker joins or leaves."""
        if old_queued == new_queued:
            return
        assert self.slots is not None
        if self._bits_releases != self.slots.releases:  # a slot was freed: it may be someone else's now
            self._bits.clear()
            self._bits_releases = self.slots.releases
        bit = self._bits.get(worker_id)
        if bit is None:
            bit = self._bits[worker_id] = 1 << self.slots.slot(worker_id)
        masks = self._queued_masks
        if old_queued is None:
            self.mask |= bit
        else:
            mask = masks[old_queued] ^ bit
            if mask:
                masks[old_queued] = mask
            else:
                del masks[old_queued]
                del self._queued_values[bisect.bisect_left(self._queued_values, old_queued)]
        if new_queued is None:
            self.mask ^= bit
            return
        joined = masks.get(new_queued)
        if joined is None:
            masks[new_queued] = bit
            bisect.insort(self._queued_values, new_queued)
        else:
            masks[new_queued] = joined | bit

    # ---- reads ------------------------------------------------------------------------------------
    def get(self, worker_id: str) -> WorkerLoad | None:
        return self._loads.get(worker_id)

    def has(self, worker_id: str) -> bool:
        return worker_id in self._loads

    @property
    def ids(self) -> frozenset[str]:
        """The workers' ids; the same object until membership changes."""
        if self._ids is None:
            self._ids = frozenset(self._loads)
        return self._ids

    def least(self) -> WorkerLoad:
        """Fewest queued prompt tokens, then fewest requests, then the smallest id (`base.least_loaded`)."""
        if not self._keys:
            raise IndexError("an empty LoadBook has no least loaded worker")
        return self._loads[self._buckets[self._keys[0]][0]]

    def least_queued_of(self, worker_ids: Iterable[str]) -> int | None:
        """The fewest queued tokens among those of `worker_ids` in the book (None: none is)."""
        # One call for a whole level, the look-ups mapped in C: a Python-level call per member cost more
        # than the look-up itself (this is the simulator's hottest listing at fleet size).
        queues = [load.queued_prompt_tokens for load in map(self._loads.get, worker_ids) if load is not None]
        return min(queues) if queues else None

    def min_queued(self) -> int:
        return self._keys[0][0]

    def ascending(self) -> Iterator[WorkerLoad]:
        """Every worker by (queued tokens, requests, id); the book must not change during the walk."""
        for key in self._keys:
            for worker_id in self._buckets[key]:
                yield self._loads[worker_id]

    def masks_ascending(self) -> Iterator[tuple[int, int]]:
        """(queued tokens, mask of the workers queueing exactly that) by queued tokens; needs `slots`."""
        masks = self._queued_masks
        for queued in self._queued_values:
            yield queued, masks[queued]

    def mask_with_queued(self, queued: int) -> int:
        """The mask of the workers queueing exactly `queued` tokens; needs `slots`."""
        return self._queued_masks.get(queued, 0)

    def with_queued(self, queued: int) -> Iterator[str]:
        """The ids of the workers with exactly `queued` queued tokens, by (requests, id)."""
        for i in range(bisect.bisect_left(self._keys, (queued, -1)), len(self._keys)):
            key = self._keys[i]
            if key[0] != queued:
                return
            yield from self._buckets[key]

    def count_queued(self, queued: int) -> int:
        """How many workers have exactly `queued` queued tokens."""
        total = 0
        for i in range(bisect.bisect_left(self._keys, (queued, -1)), len(self._keys)):
            key = self._keys[i]
            if key[0] != queued:
                break
            total += len(self._buckets[key])
        return total

    def check_integrity(self) -> None:
        assert self._keys == sorted(self._buckets), "bucket keys out of order"
        filed = [w for key in self._keys for w in self._buckets[key]]
        assert sorted(filed) == sorted(self._loads), "buckets disagree with the loads"
        for key, bucket in self._buckets.items():
            assert bucket == sorted(bucket) and bucket, f"bucket {key} empty or unsorted"
            for worker_id in bucket:
                load = self._loads[worker_id]
                assert (load.queued_prompt_tokens, load.inflight_requests) == key, f"{worker_id} in the wrong bucket"
        assert self.total_queued == sum(w.queued_prompt_tokens for w in self._loads.values()), "total_queued drifted"
        if self.slots is not None:
            expected: dict[int, int] = {}
            for worker_id, load in self._loads.items():
                bit = 1 << self.slots.slot(worker_id)
                expected[load.queued_prompt_tokens] = expected.get(load.queued_prompt_tokens, 0) | bit
            assert self._queued_masks == expected, "queue masks disagree with the loads"
            assert self._queued_values == sorted(expected), "queue lengths out of order"
            assert self.mask == self.slots.mask_of(set(self._loads)), "the book's mask disagrees with its workers"
            if isinstance(self.slots, CountedSlots):
                assert self.slots.claimed_by(self) == set(self._loads), "the book's claims disagree with its workers"

    # ---- Sequence ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._loads)

    def __iter__(self) -> Iterator[WorkerLoad]:
        return iter(self._loads.values())

    @overload
    def __getitem__(self, index: int) -> WorkerLoad: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[WorkerLoad]: ...

    def __getitem__(self, index):
        if self._list is None:
            self._list = list(self._loads.values())
        return self._list[index]


def as_book(workers: Sequence[WorkerLoad]) -> LoadBook:
    """`workers` as a LoadBook: itself when it is one, else a new one (a scan, as a plain list costs)."""
    return workers if isinstance(workers, LoadBook) else LoadBook(workers)
