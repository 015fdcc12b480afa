"""`freeze_startup_heap`: what lives at startup leaves the collector's generations; garbage does not
get frozen with it."""

from __future__ import annotations

import gc
import weakref

import pytest

from engine.heap import CollectionPauses, freeze_startup_heap


@pytest.fixture
def unfreeze_after():
    yield
    gc.unfreeze()


class _Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the collector frees it


def test_live_objects_leave_the_generations_a_full_collection_walks(unfreeze_after):
    startup = [[i] for i in range(20_000)]  # long-lived state, as a model's modules are
    walked_before = len(gc.get_objects())
    frozen = freeze_startup_heap()
    # A frozen object freed since (by a thread an earlier test left running) leaves the permanent
    # generation, so its size can only have fallen; a fresh-clone CI run once saw 2 fewer.
    assert frozen >= gc.get_freeze_count() >= len(startup)
    assert len(gc.get_objects()) < walked_before - len(startup)
    assert startup[-1] == [19_999]  # frozen objects stay alive and usable


def test_garbage_alive_only_through_a_cycle_is_collected_not_frozen(unfreeze_after):
    node = _Node()
    freed = weakref.ref(node)
    del node
    freeze_startup_heap()
    assert freed() is None


def test_collection_pauses_times_full_collections_and_skips_younger_ones():
    heap = [[i] for i in range(200_000)]  # enough objects that a full collection takes measurable time
    with CollectionPauses() as pauses:
        gc.collect(0)
        gc.collect(1)
        assert pauses.count == 0
        gc.collect()
        gc.collect()
    gc.collect()  # after the `with`: not counted
    assert pauses.count == 2
    assert 0 < pauses.longest_s <= pauses.total_s
    assert gc.callbacks.count(pauses._callback) == 0
    assert "2 collections of generation 2" in pauses.describe()
    assert heap[-1] == [199_999]


def test_collection_pauses_of_generation_zero_counts_every_collection():
    with CollectionPauses(generation=0) as pauses:
        gc.collect(0)
        gc.collect(2)
    assert pauses.count == 2
