"""Which worker deaths count toward `router.migration_limit` before the first token: only a death while the
request was being computed. The prefill worker's stream says when the request waits (in its queue, or for
its prefix pull: `PrefillQueue`), the cluster client (`_first_token`) records the attempt's phase, and
router/migration.py counts by it; a fake stream stands in for the worker's here, so each order of markers
is checked exactly."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from cluster.client import AttemptPhase, RequestFailed, _first_token
from common.messages import PrefillQueue
from router.migration import Migrations, cause_of, counts_toward_limit

WORKER = SimpleNamespace(worker_id="prefill-0", epoch=3)


async def _stream(items):
    """Yields `items` in order, as a prefill worker's handle does; an exception item is raised where it stands."""
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield item


def _death_counts(*markers: bool) -> bool:
    async def first_token():
        stream = _stream([*(PrefillQueue("r", waiting) for waiting in markers), RayActorError()])
        with pytest.raises(RequestFailed) as failure:
            await _first_token(stream, time.monotonic() + 10, WORKER)
        assert failure.value.lost_worker == ("prefill-0", 3)
        return counts_toward_limit(failure.value)

    return asyncio.run(first_token())


def test_a_death_counts_only_while_the_request_was_being_computed():
    assert _death_counts() is True  # scheduled by the first step after it arrived: computed
    assert _death_counts(True) is False  # waiting in the queue, or for its prefix pull
    assert _death_counts(True, False) is True  # it left the queue: being computed
    assert _death_counts(True, False, True) is False  # waiting again (a step that did not schedule it)


def _failure(phase, *, lost=None, decode_lost=False, unavailable=True):
    err = RequestFailed("lost", unavailable=unavailable, lost_worker=lost, decode_lost=decode_lost)
    err.phase = phase
    return err


def test_the_limit_counts_only_losses_the_request_may_have_caused():
    migrations = Migrations(limit=1)
    migrations.migrate(_failure(AttemptPhase.QUEUED, lost=("prefill-0", 1)))  # waited: not counted
    migrations.migrate(_failure(AttemptPhase.HANDOFF, decode_lost=True))  # hand-off: not counted
    migrations.migrate(_failure(AttemptPhase.HANDOFF, lost=("prefill-0", 2)))
    assert (migrations.total, migrations.counted) == (3, 0)
    migrations.migrate(_failure(AttemptPhase.DECODE, lost=("decode-0", 1)))  # computing it: counted
    assert (migrations.total, migrations.counted) == (4, 1)
    migrations.migrate(_failure(AttemptPhase.HANDOFF, lost=("prefill-1", 1)))  # not counted: still moves
    with pytest.raises(RequestFailed, match=r"after 1 migration\(s\), the limit") as spent:
        migrations.migrate(_failure(AttemptPhase.PREFILL, lost=("prefill-1", 2)))
    assert spent.value.unavailable and (migrations.total, migrations.counted) == (5, 1)


def test_only_worker_loss_migrates_and_the_cause_names_the_lost_part():
    refused = _failure(AttemptPhase.PREFILL, unavailable=False)
    with pytest.raises(RequestFailed) as raised:
        Migrations(limit=3).migrate(refused)
    assert raised.value is refused
    prefill, decode = SimpleNamespace(worker_id="p", epoch=1), SimpleNamespace(worker_id="d", epoch=2)
    assert cause_of(_failure(AttemptPhase.PREFILL, lost=("p", 1)), prefill, decode) == "prefill_lost"
    assert cause_of(_failure(AttemptPhase.DECODE, lost=("d", 2)), prefill, decode) == "decode_lost"
    assert cause_of(_failure(AttemptPhase.HANDOFF, decode_lost=True), prefill, decode) == "handoff_failed"
    assert cause_of(_failure(AttemptPhase.DECODE), prefill, decode) == "worker_failed"
    assert cause_of(_failure(AttemptPhase.PREFILL, lost=("p", 0)), prefill, decode) == "worker_failed"  # old epoch
