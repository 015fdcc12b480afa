"""The ``KVTransport`` contract (see its docstring), checked on real processes and process groups.

Parameterised over backends by the ``cluster`` fixture (conftest): gloo always, nccl when two CUDA
devices exist. Run inside the sandbox: ``scripts/in_sandbox.sh .venv/bin/python -m pytest tests/kvtransfer``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:  # the agents come from conftest fixtures; names are for annotations only
    from conftest import Agent, Cluster

SLACK_S = 1.0  # allowed lateness of a TransferError past timeout_s (the contract promises "well under")
pytestmark = pytest.mark.timeout(90)


def send(peer: Agent, tensors: list[torch.Tensor], timeout_s: float = 10.0) -> dict:
    return {"op": "send", "peer": peer.local_id, "tensors": tensors, "timeout_s": timeout_s}


def recv(peer: Agent, like: list[torch.Tensor], timeout_s: float = 10.0, strided: bool = False) -> dict:
    """Receive into fresh garbage-filled buffers shaped like ``like``; ``strided``: every other one
    is a non-contiguous view."""
    specs = [(tuple(t.shape), t.dtype, not (strided and i % 2)) for i, t in enumerate(like)]
    return {"op": "recv", "peer": peer.local_id, "specs": specs, "timeout_s": timeout_s}


def close_peer(peer: Agent) -> dict:
    return {"op": "close_peer", "peer": peer.local_id}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_received(result: dict, want: list[torch.Tensor]) -> None:
    assert result["ok"], result
    got = result["tensors"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        assert torch.equal(bits(g), bits(w)), f"{w.dtype}{list(w.shape)} differs"
    assert result["num_bytes"] == sum(t.numel() * t.element_size() for t in want)


def assert_failed(result: dict, *, within_s: float, text: str = "") -> None:
    assert not result["ok"] and result["type"] == "TransferError", result
    assert result["elapsed_s"] <= within_s + SLACK_S, result
    assert text in result["error"], result


def assert_ok(results: list[dict]) -> None:
    assert all(r["ok"] for r in results), results


def transfer(sender: Agent, receiver: Agent, tensors: list[torch.Tensor]) -> None:
    """One message sender -> receiver that must succeed and arrive bitwise intact."""
    sender.start(send(receiver, tensors))
    assert_received(receiver.run(recv(sender, tensors))[0], tensors)
    assert_ok(sender.result())


def payload(seed: int) -> list[torch.Tensor]:
    """Several dtypes and shapes: empty, 0-dim, strided, and one 9.6 MB tensor spanning 4 MiB chunks."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 5, generator=gen),
        torch.randn(2, 16, 4, 8, generator=gen).bfloat16(),
        torch.randn(7, generator=gen).half(),
        torch.randint(-(2**40), 2**40, (4, 4), generator=gen),
        torch.empty(0, 3),
        torch.rand(11, generator=gen) > 0.5,
        torch.randn(5, 9, generator=gen).t(),
        torch.tensor(3.5, dtype=torch.float64),
        torch.randn(2_400_000, generator=gen),
    ]


def small(value: int) -> list[torch.Tensor]:
    return [torch.full((1000,), float(value)), torch.full((3,), -value, dtype=torch.int32)]


def test_round_trip_mixed_dtypes_is_bitwise(cluster: Cluster) -> None:
    a, b = cluster.fresh_ids()["a"], cluster.agents["b"]
    tensors = payload(seed=1)
    a.start(send(b, tensors))
    assert_received(b.run(recv(a, tensors, strided=True))[0], tensors)
    assert a.result()[0]["num_bytes"] == sum(t.numel() * t.element_size() for t in tensors)
    transfer(b, a, payload(seed=2))  # the other direction of the same pair


def test_consecutive_sends_arrive_in_order(cluster: Cluster) -> None:
    a, b = cluster.fresh_ids()["a"], cluster.agents["b"]
    a.start(*[send(b, small(i)) for i in range(6)])
    results = b.run(*[recv(a, small(0)) for _ in range(6)])
    for i, result in enumerate(results):
        assert_received(result, small(i))
    assert_ok(a.result())


def test_two_peers_talk_to_one_process(cluster: Cluster) -> None:
    agents = cluster.fresh_ids()
    a, b, c = agents["a"], agents["b"], agents["c"]
    # Both senders are in flight at once; b serves them one after the other, in either order.
    for first, second in ((a, c), (c, a)):
        a.start(send(b, small(1)))
        c.start(send(b, small(2)))
        results = b.run(recv(first, small(0)), recv(second, small(0)))
        assert_received(results[0], small(1 if first is a else 2))
        assert_received(results[1], small(2 if first is a else 1))
        assert_ok(a.result() + c.result())
    # Calls for different peers may also run concurrently from two threads.
    a.start(send(b, small(3)))
    c.start(send(b, small(4)))
    both = b.run({"op": "parallel", "ops": [recv(a, small(0)), recv(c, small(0))]})[0]["results"]
    assert_received(both[0], small(3))
    assert_received(both[1], small(4))
    assert_ok(a.result() + c.result())


def test_second_concurrent_call_for_one_peer_is_refused(cluster: Cluster) -> None:
    a, b = cluster.fresh_ids()["a"], cluster.agents["b"]
    a.start({"op": "sleep", "s": 0.5}, send(b, small(5)))
    both = b.run({"op": "parallel", "ops": [recv(a, small(0)), recv(a, small(0))]})[0]["results"]
    refused = [r for r in both if not r["ok"]]
    assert len(refused) == 1 and refused[0]["type"] == "RuntimeError", both
    assert_received(next(r for r in both if r["ok"]), small(5))
    assert_ok(a.result())


def test_pair_is_recreated_after_close_peer(cluster: Cluster) -> None:
    a, b = cluster.fresh_ids()["a"], cluster.agents["b"]
    transfer(a, b, small(1))
    assert_ok(a.run(close_peer(b)) + b.run(close_peer(a)))  # both sides close
    transfer(a, b, small(2))
    assert_ok(a.run(close_peer(b)))  # one side closes: the other follows without an error
    transfer(a, b, small(3))
    assert_ok(b.run(close_peer(a)))
    transfer(b, a, small(4))
    assert_ok(a.run(close_peer(b), close_peer(b)))  # idempotent


def test_forget_peer_closes_an_idle_channel_once_and_later_calls_fail_at_once(cluster: Cluster) -> None:
    a, b = cluster.fresh_ids()["a"], cluster.agents["b"]
    transfer(a, b, small(1))
    first, again = a.run({"op": "forget_peer", "peer": b.local_id}, {"op": "forget_peer", "peer": b.local_id})
    assert (first["closed"], again["closed"]) == (True, False)  # idle channel closed; then nothing to close
    gone = a.run(send(b, small(2)))[0]  # a forgotten peer left the cluster: nothing can reach it again
    assert (gone["ok"], gone["type"]) == (False, "PeerGone") and gone["elapsed_s"] < 0.5, gone


def test_forget_peer_stops_a_call_waiting_for_the_peer_to_open_a_channel(cluster: Cluster) -> None:
    """A send to a peer that never joins (it died before its channel formed) would wait out its timeout;
    forgetting the peer ends it within the handshake's poll instead."""
    a = cluster.fresh_ids()["a"]
    ghost = {"op": "send", "peer": "ghost-of-b", "tensors": small(1), "timeout_s": 20.0}
    waiting, _ = a.run({"op": "parallel", "ops": [ghost, {"op": "forget_peer", "peer": "ghost-of-b", "after_s": 0.5}]})[0][
        "results"
    ]
    assert (waiting["ok"], waiting["type"]) == (False, "PeerGone") and waiting["elapsed_s"] < 2.0, waiting


def test_forget_peer_leaves_a_call_in_flight_alone(cluster: Cluster) -> None:
    a, b = cluster.fresh_ids()["a"], cluster.agents["b"]
    transfer(a, b, small(1))
    a.start({"op": "parallel", "ops": [recv(b, small(0)), {"op": "forget_peer", "peer": b.local_id, "after_s": 0.3}]})
    assert_ok(b.run({"op": "sleep", "s": 0.6}, send(a, small(3))))
    receive, forget = a.result()[0]["results"]
    assert_received(receive, small(3))
    assert forget["closed"] is False


def test_peer_closing_while_we_wait_is_followed(cluster: Cluster) -> None:
    a, b = cluster.fresh_ids()["a"], cluster.agents["b"]
    transfer(a, b, small(1))
    b.start(recv(a, small(0)))  # waits on the channel that a is about to close
    assert_ok(a.run({"op": "sleep", "s": 0.3}, close_peer(b), send(b, small(2))))
    assert_received(b.result()[0], small(2))


def test_pool_eviction_with_one_slot(cluster: Cluster) -> None:
    agents = cluster.fresh_ids(b=1)
    a, b, c = agents["a"], agents["b"], agents["c"]
    a.start(send(b, small(1)), send(b, small(3)), recv(b, small(0)))
    c.start(send(b, small(2)), send(b, small(4)), recv(b, small(0)))
    results = b.run(
        recv(a, small(0)), recv(c, small(0)), recv(a, small(0)), recv(c, small(0)),
        send(a, small(5)), send(c, small(6)),
    )
    for result, value in zip(results, (1, 2, 3, 4)):
        assert_received(result, small(value))
    assert_ok(results)
    a_results, c_results = a.result(), c.result()
    assert_received(a_results[2], small(5))
    assert_received(c_results[2], small(6))


def test_recv_without_send_times_out_and_both_sides_learn(cluster: Cluster) -> None:
    agents = cluster.fresh_ids()
    a, b, c = agents["a"], agents["b"], agents["c"]
    transfer(a, b, small(1))
    result = b.run(recv(a, small(0), timeout_s=1.0))[0]
    assert_failed(result, within_s=1.0, text="timed out")
    assert result["elapsed_s"] >= 0.95
    # a was idle when it broke: its next call reports the reset once, then the pair works again.
    assert_failed(a.run(send(b, small(2), timeout_s=3.0))[0], within_s=3.0, text="reset")
    transfer(a, b, small(3))
    # Same on a pair that never connected, and for a send nobody receives.
    assert_failed(b.run(recv(c, small(0), timeout_s=1.0))[0], within_s=1.0)
    assert_failed(b.run(send(a, small(4), timeout_s=1.0))[0], within_s=1.0, text="timed out")
    assert_failed(a.run(recv(b, small(0), timeout_s=3.0))[0], within_s=3.0, text="reset")
    transfer(c, b, small(5))
    transfer(b, a, small(6))


def test_layout_mismatch_fails_on_both_sides(cluster: Cluster) -> None:
    a, b = cluster.fresh_ids()["a"], cluster.agents["b"]
    for expected in ([torch.zeros(5)], [torch.zeros(4, dtype=torch.int32)], [torch.zeros(4), torch.zeros(1)]):
        a.start(send(b, [torch.ones(4)], timeout_s=5.0))
        assert_failed(b.run(recv(a, expected, timeout_s=5.0))[0], within_s=5.0, text="layout mismatch")
        assert_failed(a.result()[0], within_s=5.0, text="layout mismatch")
        transfer(a, b, small(1))


def _stream(peer: Agent, direction: str) -> dict:
    """16 MB messages back to back, seconds of traffic: a kill lands while a call is in flight."""
    return {"op": "stream", "peer": peer.local_id, "direction": direction, "count": 1000, "numel": 4 << 20,
            "timeout_s": 3.0}


def test_killed_peer_fails_fast_and_others_still_work(cluster: Cluster) -> None:
    agents = cluster.fresh_ids()
    a, b = agents["a"], agents["b"]
    victims = [cluster.spawn("victim"), cluster.spawn("victim")]  # both start now: a start costs seconds
    try:
        for i, victim in enumerate(victims):
            victim.init(f"victim{i}-{b.local_id}", backend=cluster.backend, connect_timeout_s=10.0)
        sender, receiver = victims
        for victim, victim_role, b_role in ((sender, "send", "recv"), (receiver, "recv", "send")):
            transfer(victim, b, small(1))
            b.start(_stream(victim, b_role))
            victim.start(_stream(b, victim_role))
            time.sleep(0.7)
            victim.kill()  # by PID, mid-stream
            result = b.result()[0]
            # b learns from the closed connection, well before its call's 3 s timeout ...
            assert_failed(result, within_s=0.5, text="connection lost")
            assert 0 < result["done"] < 1000, result
            # ... and stays usable for other peers.
            transfer(a, b, small(2))
        # Sending to a dead peer times out (it never joins a new channel); it never hangs.
        assert_failed(b.run(send(sender, small(3), timeout_s=1.0))[0], within_s=1.0)
    finally:
        for victim in victims:
            victim.kill()


def test_restarted_peer_with_same_id(cluster: Cluster) -> None:
    a, b = cluster.fresh_ids()["a"], cluster.agents["b"]
    first = cluster.spawn("victim")
    second = cluster.spawn("victim")  # start both now: a process start costs seconds
    try:
        first.init(f"victim-{b.local_id}", backend=cluster.backend, connect_timeout_s=10.0)
        transfer(first, b, small(1))
        first.kill()  # crashes without closing its channel
        second.init(f"victim-{b.local_id}", backend=cluster.backend, connect_timeout_s=10.0)
        second.start(send(b, small(2), timeout_s=10.0))
        time.sleep(0.5)  # let the new incarnation find its generation burnt before b looks
        # b still holds the dead incarnation's channel: it learns of the restart once ...
        assert_failed(b.run(recv(second, small(0), timeout_s=5.0))[0], within_s=5.0, text="restarted")
        # ... then meets the new incarnation on a fresh channel.
        assert_received(b.run(recv(second, small(0)))[0], small(2))
        assert_ok(second.result())
        transfer(a, b, small(3))
    finally:
        first.kill()
        second.kill()
