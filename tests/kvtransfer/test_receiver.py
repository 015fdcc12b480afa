"""The receiving side of a hand-off over a real gloo transport (two transports in this process): a
refused or misfit transfer is drained, a receive whose lease ran out after it started is carried
through, and in every case the next transfer on the same channel arrives intact; quantized blocks
arrive with their scales bit for bit, and a sender storing KV in another format is refused at once,
naming both layouts. Every test runs twice: with the layers packed into messages (the default) and
with one layer a message (MESSAGE_BYTES = 1), so draining and refusing meet both."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from kvtransfer import handoff
from kvtransfer.handoff import HandoffTarget, RankTarget, layer_groups, send_sequence_kv
from kvtransfer.receiver import KVReceiver
from kvtransfer.store import create_rendezvous_store
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.transport import TransferError

SHAPE = (2, 2, 2, 8, 4, 4)  # layers, K/V, kv heads, blocks, block size, head dim


def _storage(kv_cache_dtype: str = "auto", heads: int = SHAPE[2], seed: int | None = None) -> KVCacheStorage:
    """A cache of SHAPE (with `heads` KV heads); random contents when `seed` is given, else zeros."""
    layers, _, _, blocks, block_size, head_dim = SHAPE
    storage = KVCacheStorage(kv_format(kv_cache_dtype, torch.float32), layers, heads, blocks, block_size, head_dim)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for layer in range(layers):
            k, v = (torch.randn(blocks * block_size, heads, head_dim, generator=gen) for _ in range(2))
            storage.layer(layer).write(k, v, torch.arange(blocks * block_size))
    return storage


def _blocks(storage: KVCacheStorage, block_ids, heads: slice = slice(None)) -> list[torch.Tensor]:
    """The stored bytes of `block_ids` (values, and scales for quantized formats), for exact comparison."""
    out = [storage.values[:, :, heads][:, :, :, list(block_ids)].view(torch.uint8)]
    if storage.scales is not None:
        out.append(storage.scales[:, :, heads][:, :, :, list(block_ids)])
    return out


def _same_blocks(receiver: KVReceiver, ids, source: KVCacheStorage, source_ids, heads: slice = slice(None)) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_blocks(receiver.kv, ids), _blocks(source, source_ids, heads)))


@pytest.fixture(autouse=True, params=["packed", "a layer a message"])
def message_bytes(request, monkeypatch):
    if request.param != "packed":
        monkeypatch.setattr(handoff, "MESSAGE_BYTES", 1)


@pytest.fixture
def pair():
    store = create_rendezvous_store()
    sender = TorchDistTransport("prefill-x", store.host, store.port)
    receiver_transport = TorchDistTransport("decode-x/rank0", store.host, store.port)
    yield sender, receiver_transport
    sender.close()
    receiver_transport.close()


def _send_async(sender, cache: KVCacheStorage, block_ids: tuple[int, ...], request_id: str) -> dict:
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


def _next_transfer_arrives_intact(sender, receiver: KVReceiver, source: KVCacheStorage) -> None:
    receiver.expect("next", (5, 6), time.time() + 5.0)
    sent = _send_async(sender, source, (1, 2), "next")
    receiver.receive("prefill-x", "next")
    sent["thread"].join(10)
    assert "error" not in sent
    assert _same_blocks(receiver, [5, 6], source, [1, 2])


def test_a_transfer_that_does_not_fit_the_reservation_is_drained(pair):
    sender, receiver_transport = pair
    source = _storage(seed=0)
    receiver = KVReceiver(receiver_transport, _storage())
    receiver.expect("misfit", (0, 1), time.time() + 5.0)
    sent = _send_async(sender, source, (1, 2, 3), "misfit")  # three blocks for a two-block reservation
    with pytest.raises(TransferError, match="sender has 3 blocks, the reservation 2"):
        receiver.receive("prefill-x", "misfit")
    sent["thread"].join(10)
    assert "refused" in str(sent["error"])  # the sender learns it through the ack
    assert not receiver.kv.values[:, :, :, [0, 1]].any()  # nothing written into the reserved blocks
    _next_transfer_arrives_intact(sender, receiver, source)


def test_a_cancelled_transfer_is_drained_and_refused(pair):
    sender, receiver_transport = pair
    source = _storage(seed=0)
    receiver = KVReceiver(receiver_transport, _storage())
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
    source = _storage(seed=0)
    receiver = KVReceiver(receiver_transport, _storage())
    receiver.expect("late", (0, 1), time.time() + 0.2)
    receiver.delay_s = 0.4  # accepted in time, then stalls past the lease before reading the header
    sent = _send_async(sender, source, (3, 4), "late")
    receiver.receive("prefill-x", "late")
    receiver.delay_s = 0.0
    sent["thread"].join(10)
    assert "error" not in sent and receiver.wait("late", 1.0) == 2
    assert _same_blocks(receiver, [0, 1], source, [3, 4])
    _next_transfer_arrives_intact(sender, receiver, source)


def test_a_pull_expectation_accepts_fewer_blocks_and_reports_them(pair):
    sender, receiver_transport = pair
    source = _storage(seed=0)
    receiver = KVReceiver(receiver_transport, _storage())
    receiver.expect("pull", (4, 5, 6), time.time() + 5.0, allow_fewer_blocks=True)
    sent = _send_async(sender, source, (0, 1), "pull")  # the holder had only two of the three
    receiver.receive("prefill-x", "pull")
    sent["thread"].join(10)
    assert receiver.wait("pull", 1.0) == 2
    assert _same_blocks(receiver, [4, 5], source, [0, 1])
    assert not receiver.kv.values[:, :, :, 6].any()


def test_a_refusal_by_one_rank_leaves_no_ack_of_another_unread():
    """Tensor-parallel decode: every rank acks; when rank 0 refuses, rank 1's ack must still be read,
    or the next hand-off to rank 1 would take that stale ack for its own."""
    store = create_rendezvous_store()
    sender = TorchDistTransport("prefill-x", store.host, store.port)
    # one KV head per rank
    receivers = [KVReceiver(TorchDistTransport(f"decode-x/rank{r}", store.host, store.port), _storage(heads=1))
                 for r in range(2)]
    ranks = tuple(RankTarget(f"decode-x/rank{r}", r, r + 1) for r in range(2))
    source = _storage(seed=0)
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
            assert _same_blocks(receiver, [5, 6], source, [1, 2], slice(r, r + 1))
    finally:
        sender.close()
        for receiver in receivers:
            receiver.transport.close()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_blocks_and_their_scales_arrive_as_stored(pair, kv_cache_dtype):
    sender, receiver_transport = pair
    source = _storage(kv_cache_dtype, seed=1)
    receiver = KVReceiver(receiver_transport, _storage(kv_cache_dtype))
    receiver.expect("q", (2, 7, 0), time.time() + 5.0)
    sent = _send_async(sender, source, (6, 1, 3), "q")
    receiver.receive("prefill-x", "q")
    sent["thread"].join(10)
    layers, _, heads, _, block_size, head_dim = SHAPE
    assert sent["bytes"] == layers * 2 * heads * 3 * block_size * (head_dim + 4)  # 1-byte values + fp32 scales
    assert _same_blocks(receiver, [2, 7, 0], source, [6, 1, 3])


def test_a_sender_storing_kv_in_another_format_is_refused_at_once_naming_both(pair):
    sender, receiver_transport = pair
    receiver = KVReceiver(receiver_transport, _storage("fp8"))
    receiver.expect("mixed", (0, 1), time.time() + 30.0)
    started_s = time.monotonic()
    sent = _send_async(sender, _storage("int8", seed=2), (1, 2), "mixed")
    with pytest.raises(TransferError) as caught:
        receiver.receive("prefill-x", "mixed")
    sent["thread"].join(10)
    assert time.monotonic() - started_s < 5.0  # the channel failed on both sides, not at a timeout
    assert "KV layout mismatch: sender 'prefill-x' stores [kv int8" in str(caught.value)
    assert "this worker stores [kv fp8" in str(caught.value)
    assert "error" in sent and "layout mismatch" in str(sent["error"])
    assert not receiver.kv.values.view(torch.uint8).any()
    with pytest.raises(TransferError, match="KV layout mismatch"):
        receiver.wait("mixed", 1.0)
    _next_transfer_arrives_intact(sender, receiver, _storage("fp8", seed=3))


def test_layers_pack_into_messages_of_at_most_message_bytes(monkeypatch):
    mib = 1 << 20
    monkeypatch.setattr(handoff, "MESSAGE_BYTES", 4 * mib)
    assert layer_groups(12, mib) == [range(0, 4), range(4, 8), range(8, 12)]
    assert layer_groups(12, 5 * mib) == [range(i, i + 1) for i in range(12)]  # a large layer goes alone
    assert layer_groups(5, 2 * mib) == [range(0, 2), range(2, 4), range(4, 5)]


def test_uneven_groups_of_layers_arrive_intact(pair, monkeypatch):
    """Five layers, two a message: the last message holds one layer, and its staging another shape."""
    sender, receiver_transport = pair
    layers, _, heads, blocks, block_size, head_dim = 5, *SHAPE[1:]
    source, empty = (KVCacheStorage(kv_format("int8", torch.float32), layers, heads, blocks, block_size, head_dim)
                     for _ in range(2))
    gen = torch.Generator().manual_seed(4)
    for layer in range(layers):
        k, v = (torch.randn(blocks * block_size, heads, head_dim, generator=gen) for _ in range(2))
        source.layer(layer).write(k, v, torch.arange(blocks * block_size))
    one_layer_bytes = sum(t.nbytes for t in source.staging(3))
    monkeypatch.setattr(handoff, "MESSAGE_BYTES", 2 * one_layer_bytes)
    assert len(layer_groups(layers, one_layer_bytes)) == 3
    receiver = KVReceiver(receiver_transport, empty)
    receiver.expect("uneven", (4, 0, 2), time.time() + 5.0)
    sent = _send_async(sender, source, (1, 6, 3), "uneven")
    receiver.receive("prefill-x", "uneven")
    sent["thread"].join(10)
    assert "error" not in sent
    assert _same_blocks(receiver, [4, 0, 2], source, [1, 6, 3])
