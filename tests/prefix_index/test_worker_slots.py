"""WorkerSlots: stable small integers for worker ids, reused smallest first, listed back from masks."""

from __future__ import annotations

import random

import pytest

from prefix_index.worker_slots import CountedSlots, WorkerSlots


def test_slots_are_assigned_on_first_sight_and_reused_smallest_first():
    slots = WorkerSlots()
    assert [slots.slot(w) for w in ("a", "b", "c", "a")] == [0, 1, 2, 0]
    slots.release("b")
    slots.release("a")
    slots.release("unknown")  # a no-op
    assert slots.get("a") is None and slots.releases == 2
    assert slots.slot("d") == 0 and slots.slot("e") == 1 and slots.slot("f") == 3
    assert slots.owners == {0: "d", 1: "e", 2: "c", 3: "f"}
    slots.check_integrity()


def test_owners_of_lists_a_mask_back_in_slot_order():
    slots = WorkerSlots()
    ids = [f"w{i}" for i in range(300)]
    for worker_id in ids:
        slots.slot(worker_id)
    rng = random.Random(0)
    chosen = sorted(rng.sample(range(300), 77))
    mask = slots.mask_of({ids[i] for i in chosen})
    assert mask == sum(1 << i for i in chosen)
    assert slots.owners_of(mask) == [ids[i] for i in chosen]
    assert slots.owners_of(0) == []
    slots.release("w5")
    with pytest.raises(KeyError):
        slots.owners_of(1 << 5)  # a bit whose worker left


def test_counted_slots_are_freed_when_their_last_claimant_lets_go():
    slots = CountedSlots()
    index, book = object(), object()
    assert slots.claim("a", index) == 0 and slots.claim("a", book) == 0 and slots.claim("b", book) == 1
    slots.claim("a", index)  # a second claim by the same user is the same claim
    slots.unclaim("a", index)
    assert slots.get("a") == 0 and slots.claimed_by(book) == {"a", "b"} and slots.claimed_by(index) == set()
    slots.unclaim("a", book)
    assert slots.get("a") is None and slots.releases == 1
    assert slots.claim("c", index) == 0  # the freed slot, to a new worker, only now
    slots.unclaim("unknown", book)  # a no-op
    slots.check_integrity()
    slots.slot("d")  # assigned with no claimant: a leak the integrity check names
    with pytest.raises(AssertionError, match="without a claimant"):
        slots.check_integrity()


def test_a_plain_registry_keeps_slots_until_released():
    slots = WorkerSlots()
    assert slots.claim("a", object()) == 0
    slots.unclaim("a", object())
    assert slots.get("a") == 0 and slots.releases == 0
