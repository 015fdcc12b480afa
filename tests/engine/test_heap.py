"""`freeze_startup_heap`: what lives at startup leaves the collector's generations; garbage does not
get frozen with it."""

from __future__ import annotations

import gc
import weakref

import pytest

from engine.heap import freeze_startup_heap


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
    assert frozen == gc.get_freeze_count() >= len(startup)
    assert len(gc.get_objects()) < walked_before - len(startup)
    assert startup[-1] == [19_999]  # frozen objects stay alive and usable


def test_garbage_alive_only_through_a_cycle_is_collected_not_frozen(unfreeze_after):
    node = _Node()
    freed = weakref.ref(node)
    del node
    freeze_startup_heap()
    assert freed() is None
