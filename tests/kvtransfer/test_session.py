"""The hand-off session's steps, exactly: a full decode pool is waited out (never a failure before the
request's deadline), every failure after the reservation cancels it, the prefill pins are released
exactly once whatever happens, an abort stops the session, and one sender's hand-offs are announced
one at a time (a decode rank takes a sender's hand-offs in announce order). The decode side here is a
scripted endpoint; the same session runs between real actors in tests/cluster."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtransfer.handoff import HandoffTarget, RankTarget
from kvtransfer.session import DecodeEndpoint, DecodeFull, HandoffFailed, HandoffSession, HandoffTimeouts, KVSender
from kvtransfer.transport import PeerGone

RANKS = (RankTarget("d@1/rank0", 0, 1), RankTarget("d@1/rank1", 1, 2))
FAST = HandoffTimeouts(call_s=1.0, full_backoff_min_s=0.01, full_backoff_max_s=0.02)


class ScriptedDecode(DecodeEndpoint):
    def __init__(self, log: list, full_times: int = 0, adopt_error: Exception | None = None, kv_layout: str = ""):
        self.log, self.full_times, self.adopt_error, self.kv_layout = log, full_times, adopt_error, kv_layout

    async def reserve(self, num_tokens: int) -> HandoffTarget:
        self.log.append(("reserve", num_tokens))
        if self.full_times:
            self.full_times -= 1
            raise DecodeFull("no room")
        return HandoffTarget("d", RANKS, (3, 4), time.time() + 5, self.kv_layout)

    def announce(self, rank: RankTarget):
        self.log.append(("announce", rank.peer_id))

        async def stored() -> None:
            await asyncio.sleep(0.05)
            self.log.append(("stored", rank.peer_id))
        return stored()

    async def adopt(self) -> None:
        self.log.append(("adopt",))
        if self.adopt_error is not None:
            raise self.adopt_error

    async def cancel(self) -> None:
        self.log.append(("cancel",))


def _session(log, endpoint, sender, *, send_error=None, deadline_s=5.0, rid="r", kv_layout=None):
    def send(target: HandoffTarget) -> int:
        log.append(("send", rid))
        time.sleep(0.02)
        if send_error is not None:
            raise send_error
        return 1000

    return HandoffSession(rid, 40, endpoint, send, lambda: log.append(("release", rid)), sender,
                          time.time() + deadline_s, FAST, kv_layout=kv_layout)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def sender():
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown()


def test_a_full_pool_is_waited_out_then_the_steps_run_in_order(sender):
    log = []

    async def go():
        return await _session(log, ScriptedDecode(log, full_times=2), KVSender(sender)).run()

    stats = _run(go())
    assert stats.num_bytes == 1000 and stats.elapsed_s > 0
    assert [e[0] for e in log] == ["reserve"] * 3 + ["announce", "announce", "send", "stored", "stored",
                                                     "release", "adopt"]


def test_a_pool_full_until_the_deadline_fails_at_reserve_and_releases(sender):
    log = []

    async def go():
        return await _session(log, ScriptedDecode(log, full_times=10**6), KVSender(sender), deadline_s=0.2).run()

    with pytest.raises(HandoffFailed) as err:
        _run(go())
    assert err.value.step == "reserve" and "deadline" in err.value.reason
    assert log.count(("release", "r")) == 1 and ("cancel",) not in log


def test_a_failed_send_cancels_the_reservation_and_releases_once(sender):
    log = []

    async def go():
        await _session(log, ScriptedDecode(log), KVSender(sender), send_error=OSError("peer reset")).run()

    with pytest.raises(HandoffFailed) as err:
        _run(go())
    assert err.value.step == "send" and "peer reset" in err.value.reason and not err.value.decode_lost
    assert log[-2:] == [("release", "r"), ("cancel",)] and log.count(("release", "r")) == 1


def test_a_send_to_a_peer_that_left_the_cluster_is_a_lost_decode_instance(sender):
    """The transport says the rank's peer left (forgotten on a membership change): the instance is gone,
    which the router does not count against the request (`migration_limit`)."""
    log = []

    async def go():
        gone = PeerGone("d@1/rank0", "the peer left the cluster")
        await _session(log, ScriptedDecode(log), KVSender(sender), send_error=gone).run()

    with pytest.raises(HandoffFailed) as err:
        _run(go())
    assert err.value.step == "send" and err.value.decode_lost
    assert log.count(("release", "r")) == 1


def test_a_failed_adopt_cancels_after_the_pins_went(sender):
    log = []

    async def go():
        await _session(log, ScriptedDecode(log, adopt_error=RuntimeError("instance died")), KVSender(sender)).run()

    with pytest.raises(HandoffFailed) as err:
        _run(go())
    assert (err.value.step, err.value.decode_lost) == ("adopt", True)
    assert log[-3:] == [("release", "r"), ("adopt",), ("cancel",)] and log.count(("release", "r")) == 1


def test_an_aborted_session_stops_before_reserving(sender):
    log = []

    async def go():
        session = _session(log, ScriptedDecode(log), KVSender(sender))
        session.cancel()
        await session.run()

    with pytest.raises(HandoffFailed, match="aborted"):
        _run(go())
    assert log == [("release", "r")]


def test_an_abort_during_a_full_pool_wait_ends_it_promptly(sender):
    log = []

    async def go():
        session = _session(log, ScriptedDecode(log, full_times=10**6), KVSender(sender), deadline_s=60)
        task = asyncio.ensure_future(session.run())
        await asyncio.sleep(0.1)
        started_s = time.monotonic()
        session.cancel()
        with pytest.raises(HandoffFailed, match="aborted"):
            await task
        return time.monotonic() - started_s

    assert _run(go()) < 0.5
    assert log[-1] == ("release", "r")


def test_one_senders_hand_offs_are_announced_one_at_a_time(sender):
    log = []

    async def go():
        kv_sender = KVSender(sender)
        endpoint = ScriptedDecode(log)
        await asyncio.gather(*(_session(log, endpoint, kv_sender, rid=rid).run() for rid in ("a", "b", "c")))

    _run(go())
    steps = [e for e in log if e[0] in ("announce", "stored")]
    # Each hand-off's two announces and two stores complete before the next one's first announce.
    assert [e[0] for e in steps] == ["announce", "announce", "stored", "stored"] * 3


def test_a_pair_storing_kv_differently_refuses_before_anything_moves_naming_both(sender):
    log = []
    endpoint = ScriptedDecode(log, kv_layout="kv fp8 (fp32 scale per token and KV head), block_size 16")

    async def go():
        layout = ("prefill worker 'p'", "kv int8 (fp32 scale per token and KV head), block_size 16")
        await _session(log, endpoint, KVSender(sender), kv_layout=layout).run()

    with pytest.raises(HandoffFailed) as caught:
        _run(go())
    assert caught.value.step == "reserve" and not caught.value.decode_lost
    assert ("KV layout mismatch: prefill worker 'p' stores [kv int8 (fp32 scale per token and KV head), block_size "
            "16], decode instance 'd' stores [kv fp8") in str(caught.value)
    assert [e[0] for e in log] == ["reserve", "release", "cancel"]  # nothing announced or sent
    log.clear()
    endpoint.kv_layout = "kv int8 (fp32 scale per token and KV head), block_size 16"
    _run(go())  # the same layout hands off
    assert "send" in [e[0] for e in log]
