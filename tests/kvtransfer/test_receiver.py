"""The receiving side of a hand-off over a real gloo transport (two transports in this process): a
refused or misfit transfer is drained, a receive whose lease ran out after it started is carried
through, and in every case the next transfer on the same channel arrives intact."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtransfer.handoff import HandoffTarget, RankTarget, send_sequence_kv
from kvtransfer.receiver import KVReceiver
from kvtransfer.store import create_rendezvous_store
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.transport import TransferError

SHAPE = (2, 2, 2, 8, 4, 4)  # layers, K/V, kv heads, blocks, block size, head dim


@pytest.fixture
def pair():
    store = create_rendezvous_store()
    sender = TorchDistTransport("prefill-x", store.host, store.port)
    receiver_transport = TorchDistTransport("decode-x/rank0", store.host, store.port)
    yield sender, receiver_transport
    sender.close()
    receiver_transport.close()


def _send_async(sender, cache: torch.Tensor, block_ids: tuple[int, ...], request_id: str) -> dict:
    """Sends in a thread, as the prefill worker's sender does; the dict gets the outcome."""
    outcome: dict = {}
    target = HandoffTarget("decode-x", (RankTarget("decode-x/rank0", 0, SHAPE[2]),), (), time.time() + 5.0)

    def run():
        try:
            outcome["bytes"] = send_sequence_kv(sender, cache, block_ids, len(block_ids) * SHAPE[4], request_id,
                                                target)
        except TransferError as err:
            outcome["error"] = err

    outcome["thread"] = threading.Thread(target=run)
    outcome["thread"].start()
    return outcome


def _next_transfer_arrives_intact(sender, receiver: KVReceiver, source: torch.Tensor) -> None:
    receiver.expect("next", (5, 6), time.time() + 5.0)
    sent = _send_async(sender, source, (1, 2), "next")
    receiver.receive("prefill-x", "next")
    sent["thread"].join(10)
    assert "error" not in sent
    assert torch.equal(receiver.kv_cache[:, :, :, [5, 6]], source[:, :, :, [1, 2]])


def test_a_transfer_that_does_not_fit_the_reservation_is_drained(pair):
    sender, receiver_transport = pair
    source = torch.randn(SHAPE)
    receiver = KVReceiver(receiver_transport, torch.zeros(SHAPE))
    receiver.expect("misfit", (0, 1), time.time() + 5.0)
    sent = _send_async(sender, source, (1, 2, 3), "misfit")  # three blocks for a two-block reservation
    with pytest.raises(TransferError, match="sender has 3 blocks, the reservation 2"):
        receiver.receive("prefill-x", "misfit")
    sent["thread"].join(10)
    assert "refused" in str(sent["error"])  # the sender learns it through the ack
    assert not receiver.kv_cache[:, :, :, [0, 1]].any()  # nothing written into the reserved blocks
    _next_transfer_arrives_intact(sender, receiver, source)


def test_a_cancelled_transfer_is_drained_and_refused(pair):
    sender, receiver_transport = pair
    source = torch.randn(SHAPE)
    receiver = KVReceiver(receiver_transport, torch.zeros(SHAPE))
    receiver.expect("gone", (0, 1), time.time() + 5.0)
    receiver.cancel("gone", 1.0)
    sent = _send_async(sender, source, (1, 2), "gone")
    with pytest.raises(TransferError, match="not expected here"):
        receiver.receive("prefill-x", "gone")
    sent["thread"].join(10)
    assert "refused" in str(sent["error"])
    _next_transfer_arrives_intact(sender, receiver, source)


def test_a_receive_whose_lease_ends_after_it_started_is_carried_through(pair):
    sender, receiver_transport = pair
    source = torch.randn(SHAPE)
    receiver = KVReceiver(receiver_transport, torch.zeros(SHAPE))
    receiver.expect("late", (0, 1), time.time() + 0.2)
    receiver.delay_s = 0.4  # accepted in time, then stalls past the lease before reading the header
    sent = _send_async(sender, source, (3, 4), "late")
    receiver.receive("prefill-x", "late")
    receiver.delay_s = 0.0
    sent["thread"].join(10)
    assert "error" not in sent and receiver.wait("late", 1.0) == 2
    assert torch.equal(receiver.kv_cache[:, :, :, [0, 1]], source[:, :, :, [3, 4]])
    _next_transfer_arrives_intact(sender, receiver, source)


def test_a_pull_expectation_accepts_fewer_blocks_and_reports_them(pair):
    sender, receiver_transport = pair
    source = torch.randn(SHAPE)
    receiver = KVReceiver(receiver_transport, torch.zeros(SHAPE))
    receiver.expect("pull", (4, 5, 6), time.time() + 5.0, allow_fewer_blocks=True)
    sent = _send_async(sender, source, (0, 1), "pull")  # the holder had only two of the three
    receiver.receive("prefill-x", "pull")
    sent["thread"].join(10)
    assert receiver.wait("pull", 1.0) == 2
    assert torch.equal(receiver.kv_cache[:, :, :, [4, 5]], source[:, :, :, [0, 1]])
    assert not receiver.kv_cache[:, :, :, 6].any()


def test_a_refusal_by_one_rank_leaves_no_ack_of_another_unread():
    """Tensor-parallel decode: every rank acks; when rank 0 refuses, rank 1's ack must still be read,
    or the next hand-off to rank 1 would take that stale ack for its own."""
    store = create_rendezvous_store()
    sender = TorchDistTransport("prefill-x", store.host, store.port)
    rank_shape = (SHAPE[0], SHAPE[1], 1, *SHAPE[3:])  # one KV head per rank
    receivers = [KVReceiver(TorchDistTransport(f"decode-x/rank{r}", store.host, store.port), torch.zeros(rank_shape))
                 for r in range(2)]
    ranks = tuple(RankTarget(f"decode-x/rank{r}", r, r + 1) for r in range(2))
    source = torch.randn(SHAPE)
    try:
        def hand_off(request_id: str, expected_by: tuple[int, ...]):
            for r in expected_by:
                receivers[r].expect(request_id, (5, 6), time.time() + 5.0)
            errors: dict = {}

            def receive(r: int) -> None:
                try:
                    receivers[r].receive("prefill-x", request_id)
                except TransferError as err:
                    errors[r] = err
            threads = [threading.Thread(target=receive, args=(r,)) for r in range(2)]
            for thread in threads:
                thread.start()
            target = HandoffTarget("decode-x", ranks, (5, 6), time.time() + 5.0)
            try:
                send_sequence_kv(sender, source, (1, 2), 2 * SHAPE[4], request_id, target)
                outcome = "sent"
            except TransferError as err:
                outcome = str(err)
            for thread in threads:
                thread.join(10)
            return outcome, errors

        outcome, _ = hand_off("a", expected_by=(1,))  # rank 0 refuses, rank 1 accepts
        assert "decode-x/rank0" in outcome and "refused" in outcome
        outcome, _ = hand_off("b", expected_by=(0,))  # now rank 1 refuses: its ack, not a's, must say so
        assert "decode-x/rank1" in outcome and "refused" in outcome
        outcome, errors = hand_off("c", expected_by=(0, 1))
        assert outcome == "sent" and not errors
        for r, receiver in enumerate(receivers):
            assert torch.equal(receiver.kv_cache[:, :, :, [5, 6]], source[:, :, r:r + 1, [1, 2]])
    finally:
        sender.close()
        for receiver in receivers:
            receiver.transport.close()
