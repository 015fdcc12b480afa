"""The decode instance's outbox (decode_worker/outbox.py), with a real engine's step updates: each
router drains its own requests' tokens only, a request's tokens that pile up between polls merge into
one update, a step wakes a waiting poll once with every update of that step, and a router that stops
polling is named stale. A poll is woken once per wait, and steps while no poll waits wake nothing."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from common.messages import TokenUpdate
from decode_worker.outbox import Outbox
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.factories import TinySpec


@pytest.fixture
def engine(checkpoint):
    return LLMEngine(EngineConfig(model_dir=str(checkpoint(TinySpec())), num_kv_blocks=128))


def _add(engine: LLMEngine, rids: list[str], max_tokens: int = 4) -> None:
    for i, rid in enumerate(rids):
        engine.add_request(rid, [5 + i, 6, 7, 8], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_each_owner_drains_its_own_requests_and_pending_tokens_merge(engine):
    outbox = Outbox()
    _add(engine, ["a1", "a2", "b1"])
    for rid, owner in (("a1", "A"), ("a2", "A"), ("b1", "B")):
        outbox.assign(rid, owner)
    outbox.push_step(engine, engine.step())  # prefill: each request's first token
    outbox.push_step(engine, engine.step())  # one decode token each

    async def drain(owner: str) -> list[TokenUpdate]:
        return await outbox.drain(owner, 0.1)

    got_a, got_b = asyncio.run(drain("A")), asyncio.run(drain("B"))
    assert sorted(u.request_id for u in got_a) == ["a1", "a2"] and [u.request_id for u in got_b] == ["b1"]
    assert all(len(u.token_ids) == 2 for u in got_a + got_b)  # two steps' tokens, one update per request
    assert asyncio.run(drain("A")) == []  # drained: nothing left, the poll times out empty


def test_a_step_wakes_a_waiting_poll_once_with_all_of_its_updates(engine):
    outbox = Outbox()
    rids = [f"r{i}" for i in range(6)]
    _add(engine, rids)
    for rid in rids:
        outbox.assign(rid, "A")

    async def poll_while_the_engine_steps() -> list[TokenUpdate]:
        waiting = asyncio.ensure_future(outbox.drain("A", 5.0))
        await asyncio.sleep(0.05)  # the poll is waiting before the step lands
        stepper = threading.Thread(target=lambda: outbox.push_step(engine, engine.step()))
        stepper.start()
        updates = await waiting
        stepper.join(5.0)
        return updates

    assert sorted(u.request_id for u in asyncio.run(poll_while_the_engine_steps())) == rids


def test_finished_and_unowned_requests_and_stale_owners(engine):
    outbox = Outbox()
    _add(engine, ["done"], max_tokens=1)
    outbox.assign("done", "A")
    outbox.push_step(engine, engine.step())  # its only token: it finishes and leaves the engine
    (update,) = asyncio.run(outbox.drain("A", 0.1))
    assert update.finish_reason == "length" and "done" not in engine.seqs
    outbox.push(TokenUpdate("done", (9,), (), None))  # no owner any more: dropped
    outbox.push(TokenUpdate("never-assigned", (9,), (), None))
    assert asyncio.run(outbox.drain("A", 0.05)) == []
    assert outbox.stale_owners(60.0) == set()
    time.sleep(0.02)
    assert outbox.stale_owners(0.01) == {"A"}
    outbox.drop_owner("A")
    assert outbox.stale_owners(0.0) == set()


def test_a_waiting_poll_is_woken_once_and_steps_while_no_poll_waits_wake_nothing(engine):
    outbox = Outbox()
    _add(engine, ["r"], max_tokens=8)
    outbox.assign("r", "A")

    async def run() -> tuple[list[TokenUpdate], int, list[TokenUpdate], int]:
        loop = asyncio.get_running_loop()
        wakes = []
        schedule = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            wakes.append(callback)
            return schedule(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign, assignment]  # counts the outbox's wakes
        waiting = asyncio.ensure_future(outbox.drain("A", 5.0))
        await asyncio.sleep(0.05)  # the poll is waiting before the steps land
        for _ in range(3):  # three steps on the engine thread, in a row, before the poll runs again
            stepper = threading.Thread(target=lambda: outbox.push_step(engine, engine.step()))
            stepper.start()
            stepper.join(5.0)
        first = await waiting
        woken_while_waiting = len(wakes)
        for _ in range(2):  # no poll waits now: these steps' tokens wait for the next poll, unannounced
            outbox.push_step(engine, engine.step())
        second = await outbox.drain("A", 5.0)
        return first, woken_while_waiting, second, len(wakes)

    first, woken_while_waiting, second, wakes = asyncio.run(run())
    assert woken_while_waiting == 1 and wakes == 1
    assert [len(u.token_ids) for u in first] == [3]  # the prefill's token and two decode tokens, merged
    assert [len(u.token_ids) for u in second] == [2]
