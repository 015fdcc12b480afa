"""Which worker deaths count toward `router.migration_limit` before the first token (cluster/client.py
`_first_token`): only a death while the request was being computed. The prefill worker's stream says
when the request waits (in its queue, or for its prefix pull: `PrefillQueue`); a fake stream stands in
for the Ray one here, so each order of markers is checked exactly."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from cluster.client import RequestFailed, _first_token
from common.messages import PrefillQueue

WORKER = SimpleNamespace(worker_id="prefill-0", epoch=3)


class _Stream:
    """Yields ready refs of `items` in order; an exception item is raised where it stands."""

    def __init__(self, items):
        self._items = list(items)

    async def __anext__(self):
        if not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, BaseException):
            raise item
        ref = asyncio.get_running_loop().create_future()
        ref.set_result(item)
        return ref


def _death_counts(*markers: bool) -> bool:
    async def first_token():
        stream = _Stream([*(PrefillQueue("r", waiting) for waiting in markers), RayActorError()])
        with pytest.raises(RequestFailed) as failure:
            await _first_token(stream, time.monotonic() + 10, WORKER)
        assert failure.value.lost_worker == ("prefill-0", 3)
        return failure.value.counts_toward_limit

    return asyncio.run(first_token())


def test_a_death_counts_only_while_the_request_was_being_computed():
    assert _death_counts() is True  # scheduled by the first step after it arrived: computed
    assert _death_counts(True) is False  # waiting in the queue, or for its prefix pull
    assert _death_counts(True, False) is True  # it left the queue: being computed
    assert _death_counts(True, False, True) is False  # waiting again (a step that did not schedule it)
