"""`WorkerSlots`: small integers for worker ids, the bit each worker has in holder masks.

The in-process index keeps the holders of a block as a bitmask of worker slots. A router (or the
simulator) that keeps its workers' loads in a `LoadBook` can give the book the same `WorkerSlots`:
the book then keeps a mask of the workers at each queue length in the same bit positions, and a
routing policy answers "the least queued worker holding this prefix" or "the workers tied on cost" with
a few ANDs of masks instead of visiting workers one by one (policies/routing/cache_aware.py).

Slots are assigned on first sight, smallest free first. The structures that set a worker's bit (an
index, a book) `claim` its slot while they hold it and `unclaim` it when they let the worker go. A plain
`WorkerSlots` keeps every slot until `release` (the simulator's fixed fleet); `CountedSlots` frees a slot
when its last claimant lets go, so a router whose fleet changes shares one registry between its index
and its book, and a slot is reused only once neither holds the departed worker: a new member never
inherits its blocks or its load. Not thread-safe, like its users.
"""

from __future__ import annotations


class WorkerSlots:
    def __init__(self) -> None:
        self._slot_of: dict[str, int] = {}
        self.owners: dict[int, str] = {}  # slot → worker id (read directly by mask listings)
        self._next = 0  # the smallest slot never assigned; freed ones below it are in _free
        self._free: list[int] = []
        self.releases = 0  # how many slots were ever freed: what caches of slots check

    def slot(self, worker_id: str) -> int:
        """The worker's slot, assigned now if it has none."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            if self._free:
                slot = min(self._free)
                self._free.remove(slot)
            else:
                slot, self._next = self._next, self._next + 1
            self._slot_of[worker_id] = slot
            self.owners[slot] = worker_id
        return slot

    def get(self, worker_id: str) -> int | None:
        return self._slot_of.get(worker_id)

    def release(self, worker_id: str) -> None:
        """Frees the worker's slot for reuse (no mask may still have its bit); unknown ids are a no-op."""
        slot = self._slot_of.pop(worker_id, None)
        if slot is not None:
            del self.owners[slot]
            self._free.append(slot)
            self.releases += 1

    def claim(self, worker_id: str, user: object) -> int:
        """The worker's slot, held for `user` (the index or book setting its bit) until `unclaim`."""
        return self.slot(worker_id)

    def unclaim(self, worker_id: str, user: object) -> None:
        """`user` no longer holds the worker's bit; a plain registry keeps the slot until `release`."""

    def mask_of(self, worker_ids: list[str] | set[str] | frozenset[str]) -> int:
        """The mask with the bits of `worker_ids` set (each assigned a slot if it has none)."""
        mask = 0
        for worker_id in worker_ids:
            mask |= 1 << self.slot(worker_id)
        return mask

    def owners_of(self, mask: int) -> list[str]:
        """The workers whose bits `mask` sets, by slot; KeyError naming a bit that has no worker."""
        # A byte at a time (a table lists each byte's set bits): peeling the low bit off a wide mask
        # copies the whole int per holder, which made listing a prefix most of a fleet holds the
        # simulator's hottest call.
        owners = self.owners
        if mask.bit_count() <= FEW_BITS:  # a few holders: peel them off rather than walk every byte
            found = []
            while mask:
                low = mask & -mask
                found.append(owners[low.bit_length() - 1])
                mask ^= low
            return found
        data = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
        return [
            owners[base + bit]
            for base, byte in zip(range(0, 8 * len(data), 8), data, strict=True)
            if byte
            for bit in _BYTE_BITS[byte]
        ]

    def __len__(self) -> int:
        return len(self._slot_of)

    def check_integrity(self) -> None:
        assert {s: w for w, s in self._slot_of.items()} == self.owners, "slots and owners disagree"
        assert not set(self._free) & set(self.owners), "a freed slot is still owned"
        assert all(0 <= s < self._next for s in [*self._free, *self.owners]), "a slot out of range"
        assert len(self._free) + len(self.owners) == self._next, "a slot is lost"


class CountedSlots(WorkerSlots):
    """Slots freed when their last claimant lets go: what a router's index and prefill book share while
    membership changes (users are compared by identity)."""

    def __init__(self) -> None:
        super().__init__()
        self._users: dict[str, list[object]] = {}  # worker id → the structures holding its bit

    def claim(self, worker_id: str, user: object) -> int:
        slot = self.slot(worker_id)
        users = self._users.setdefault(worker_id, [])
        if not any(u is user for u in users):
            users.append(user)
        return slot

    def unclaim(self, worker_id: str, user: object) -> None:
        users = self._users.get(worker_id)
        if users is None:
            return
        users[:] = [u for u in users if u is not user]
        if not users:  # nobody holds its bit any more: the slot may go to a new worker
            self.release(worker_id)

    def release(self, worker_id: str) -> None:
        self._users.pop(worker_id, None)
        super().release(worker_id)

    def claimed_by(self, user: object) -> set[str]:
        """The workers whose slots `user` holds (tests compare it with what the user holds)."""
        return {w for w, users in self._users.items() if any(u is user for u in users)}

    def check_integrity(self) -> None:
        super().check_integrity()
        assert set(self._users) == set(self._slot_of), "a slot without a claimant, or a claim without a slot"


FEW_BITS = 8  # up to this many set bits, peeling each costs less than a pass over a fleet-wide mask's bytes
_BYTE_BITS = tuple(tuple(bit for bit in range(8) if byte >> bit & 1) for byte in range(256))  # byte → its set bits
