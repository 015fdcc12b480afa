"""MLA's latent cache over a real gloo transport: latent blocks (and int8 scales) arrive as stored, and
the bytes on the wire are the latent's (one vector per token and layer, no per-head K/V); a receiver
storing per-head K/V refuses a latent sender at once, naming both layouts, writes nothing, and the
channel carries the next transfer intact."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from kvtransfer.handoff import HandoffTarget, RankTarget, send_sequence_kv
from kvtransfer.receiver import KVReceiver
from kvtransfer.store import create_rendezvous_store
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.transport import TransferError

LAYERS, BLOCKS, BLOCK_SIZE, LATENT_DIM = 2, 8, 4, 24  # latent: kv_lora_rank 16 + rope 8


def _latent(kv_cache_dtype: str = "auto", seed: int | None = None) -> KVCacheStorage:
    storage = KVCacheStorage(kv_format(kv_cache_dtype, torch.float32), LAYERS, 1, BLOCKS, BLOCK_SIZE, LATENT_DIM,
                             planes=1)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            storage.latent(layer).write(torch.randn(BLOCKS * BLOCK_SIZE, LATENT_DIM, generator=gen),
                                        torch.arange(BLOCKS * BLOCK_SIZE))
    return storage


@pytest.fixture
def pair():
    store = create_rendezvous_store()
    sender = TorchDistTransport("prefill-mla", store.host, store.port)
    receiver_transport = TorchDistTransport("decode-mla/rank0", store.host, store.port)
    yield sender, receiver_transport
    sender.close()
    receiver_transport.close()


def _send_async(sender, cache: KVCacheStorage, block_ids: tuple[int, ...], request_id: str) -> dict:
    outcome: dict = {}
    target = HandoffTarget("decode-mla", (RankTarget("decode-mla/rank0", 0, 1),), (), time.time() + 5.0)

    def run():
        try:
            outcome["bytes"] = send_sequence_kv(sender, cache, block_ids, len(block_ids) * BLOCK_SIZE, request_id,
                                                target)
        except TransferError as err:
            outcome["error"] = err

    outcome["thread"] = threading.Thread(target=run)
    outcome["thread"].start()
    return outcome


def _stored(storage: KVCacheStorage, block_ids) -> list[torch.Tensor]:
    out = [storage.values[:, :, :, list(block_ids)].view(torch.uint8)]
    if storage.scales is not None:
        out.append(storage.scales[:, :, :, list(block_ids)])
    return out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_latent_blocks_arrive_as_stored_and_move_only_the_latent(pair, kv_cache_dtype):
    sender, receiver_transport = pair
    source = _latent(kv_cache_dtype, seed=1)
    receiver = KVReceiver(receiver_transport, _latent(kv_cache_dtype))
    receiver.expect("m", (2, 7, 0), time.time() + 5.0)
    sent = _send_async(sender, source, (6, 1, 3), "m")
    receiver.receive("prefill-mla", "m")
    sent["thread"].join(10)
    per_value = 4 if kv_cache_dtype == "auto" else 1
    scale = 0 if kv_cache_dtype == "auto" else 4
    assert sent["bytes"] == LAYERS * 3 * BLOCK_SIZE * (LATENT_DIM * per_value + scale)
    pairs = zip(_stored(receiver.kv, [2, 7, 0]), _stored(source, [6, 1, 3]), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_per_head_receiver_refuses_a_latent_sender_naming_both(pair):
    sender, receiver_transport = pair
    per_head = KVCacheStorage(kv_format("auto", torch.float32), LAYERS, 1, BLOCKS, BLOCK_SIZE, LATENT_DIM)
    receiver = KVReceiver(receiver_transport, per_head)
    receiver.expect("mixed", (0, 1), time.time() + 30.0)
    started_s = time.monotonic()
    sent = _send_async(sender, _latent(seed=2), (1, 2), "mixed")
    with pytest.raises(TransferError) as caught:
        receiver.receive("prefill-mla", "mixed")
    sent["thread"].join(10)
    assert time.monotonic() - started_s < 5.0  # the channel failed on both sides, not at a timeout
    assert "KV layout mismatch: sender 'prefill-mla' stores [mla latent kv float32, block_size 4" in str(caught.value)
    assert "this worker stores [kv float32, block_size 4" in str(caught.value)
    assert "error" in sent and "layout mismatch" in str(sent["error"])
    assert not per_head.values.any()
    # The same channel then carries a latent transfer into a latent cache intact.
    source, latent_receiver = _latent(seed=3), KVReceiver(receiver_transport, _latent())
    latent_receiver.expect("next", (5, 6), time.time() + 5.0)
    sent = _send_async(sender, source, (1, 2), "next")
    latent_receiver.receive("prefill-mla", "next")
    sent["thread"].join(10)
    assert "error" not in sent
    pairs = zip(_stored(latent_receiver.kv, [5, 6]), _stored(source, [1, 2]), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
