"""The KV hand-off wire protocol: how one sequence's prompt KV moves from a prefill worker to the ranks of
a decode instance, on top of any `KVTransport`.

The steps around it (reserve, announce, adopt) belong to `kvtransfer.session.HandoffSession`, which
reserves the decode blocks only after the prefill is done; see docs/architecture.md, KV hand-off.
This module owns what crosses the wire once the blocks are reserved (`HandoffTarget`: the ranks, the
same `block_ids` on each, the lease deadline) and the prefill side holds its blocks pinned:

- `send_sequence_kv`: for each decode rank a header (`HandoffHeader`: request id, token and block
  counts, the sender's KV layout), then the layers with that rank's KV heads of the sequence's blocks
  as the engine stores them (`engine.kv_storage.KVCacheStorage.export_layer`: values, and per-token
  scales for a quantized cache; never dequantized on the way), consecutive layers packed into
  messages of at most MESSAGE_BYTES (`layer_groups`; a layer larger than that goes alone). Every
  message is acknowledged before the next goes (the transport's contract); packing keeps a 512-token
  hand-off to a few round trips while the receiver copies one message's layers into its cache as the
  next is on the wire, and its staging (`message_staging`) stays bounded.
- `recv_header` / `recv_sequence_kv`: a decode rank receives into staging buffers, copies into its
  reserved blocks and acks. It refuses a header naming a KV layout other than its own
  (`layout_mismatch`; the session already compared layouts right after reserving). A rank that loses
  its peer frees nothing itself: it reports the failure, and the instance frees the reservation.

Both sides read and write their caches only through `KVCacheStorage` (its transfer methods and
`layout`), never its tensors.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_storage import KVCacheStorage
from kvtransfer.transport import KVTransport, PeerId, TransferError

REQUEST_ID_BYTES = 128  # request ids are utf-8, at most this long on the wire
KV_LAYOUT_BYTES = 192  # KVCacheStorage.layout, utf-8
ACK_OK = 1
CONVERSATION_GRACE_S = 2.0  # a started hand-off's calls may outlive its lease by this much
# Layers per message: as many whole layers as fit in this (at least one). The transport's gloo chunks
# are 4 MiB too; both sides derive the grouping from one layer's bytes, which matching layouts share.
MESSAGE_BYTES = 4 << 20


def layer_groups(num_layers: int, layer_bytes: int) -> list[range]:
    """Consecutive layers, as many per message as fit in MESSAGE_BYTES (at least one)."""
    per_message = max(1, MESSAGE_BYTES // max(layer_bytes, 1))
    return [range(start, min(start + per_message, num_layers)) for start in range(0, num_layers, per_message)]


def message_staging(kv: KVCacheStorage, num_blocks: int) -> list[tuple[range, list[torch.Tensor]]]:
    """(layers, buffers) of each message a sender of `num_blocks` blocks sends this rank: the buffers
    are `kv.staging` for each of its layers, in order; every message reuses the first one's."""
    one_layer = kv.staging(num_blocks)
    groups = layer_groups(kv.num_layers, sum(t.nbytes for t in one_layer))
    buffers = one_layer + [t for _ in range(len(groups[0]) - 1) for t in kv.staging(num_blocks)]
    return [(group, buffers[: len(group) * len(one_layer)]) for group in groups]


@dataclass(frozen=True)
class RankTarget:
    """One decode rank and the slice of KV heads [kv_head_start, kv_head_end) it holds."""

    peer_id: PeerId
    kv_head_start: int
    kv_head_end: int


@dataclass(frozen=True)
class HandoffTarget:
    """Where a sequence's KV goes: the decode instance's ranks and the blocks it reserved there."""

    instance_id: str
    ranks: tuple[RankTarget, ...]
    block_ids: tuple[int, ...]
    lease_deadline_s: float  # time.time() by which the whole hand-off must be done, on both sides
    kv_layout: str = ""  # the receiving side's KVCacheStorage.layout ("": not stated, checked on arrival)


@dataclass(frozen=True)
class HandoffHeader:
    request_id: str
    num_tokens: int  # tokens of KV carried (the prompt)
    num_blocks: int
    kv_layout: str  # the sender's KVCacheStorage.layout: the receiver stores nothing unless it is its own

    def encode(self) -> list[torch.Tensor]:
        name, layout = (
            _text(self.request_id, REQUEST_ID_BYTES, "request id"),
            _text(self.kv_layout, KV_LAYOUT_BYTES, "KV layout"),
        )
        lengths = [len(self.request_id.encode()), len(self.kv_layout.encode())]
        return [torch.tensor([*lengths, self.num_tokens, self.num_blocks], dtype=torch.int64), name, layout]

    @staticmethod
    def buffers() -> list[torch.Tensor]:
        return [
            torch.zeros(4, dtype=torch.int64),
            torch.zeros(REQUEST_ID_BYTES, dtype=torch.uint8),
            torch.zeros(KV_LAYOUT_BYTES, dtype=torch.uint8),
        ]

    @classmethod
    def decode(cls, buffers: list[torch.Tensor]) -> HandoffHeader:
        id_length, layout_length, num_tokens, num_blocks = (int(v) for v in buffers[0])
        request_id = bytes(buffers[1][:id_length].tolist()).decode()
        return cls(request_id, num_tokens, num_blocks, bytes(buffers[2][:layout_length].tolist()).decode())


def _text(text: str, size: int, what: str) -> torch.Tensor:
    raw = text.encode()
    if len(raw) > size:
        raise ValueError(f"{what} longer than {size} bytes cannot be handed off")
    out = torch.zeros(size, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def layout_mismatch(sender: str, receiver: str, sender_layout: str, receiver_layout: str) -> str | None:
    """Why two KV layouts cannot exchange blocks (naming both sides), or None when they can."""
    if sender_layout == receiver_layout:
        return None
    return (
        f"KV layout mismatch: {sender} stores [{sender_layout}], {receiver} stores [{receiver_layout}]; "
        "blocks move as stored, so both sides need the same model (per-head K/V or MLA's latent) and kv_cache_dtype"
    )


def remaining_s(deadline_s: float) -> float:
    """Seconds left before a lease deadline; raises once it passed. For deciding whether to *start* a
    hand-off (before it is announced), never inside one: see `call_timeout_s`."""
    left = deadline_s - time.time()
    if left <= 0:
        raise TransferError("-", "the hand-off lease expired")
    return left


def call_timeout_s(deadline_s: float) -> float:
    """The timeout of one transport call inside a started hand-off: the lease left, but at least
    CONVERSATION_GRACE_S. A side must never drop out of a conversation between two of its messages on
    a clock check alone: the messages it did not consume would stay on the channel and be read as
    the next hand-off's (a stale header, or two receives of one peer at once). Either both sides
    finish the conversation, or the transport fails it on both sides (a dead or stalled peer is a
    TransferError within the timeout, and the channel is torn down)."""
    return max(deadline_s - time.time(), CONVERSATION_GRACE_S)


def send_sequence_kv(
    transport: KVTransport,
    kv: KVCacheStorage,
    block_ids: Sequence[int],
    num_tokens: int,
    request_id: str,
    target: HandoffTarget,
) -> int:
    """Prefill side: send one sequence's KV to every rank of the target and collect their acks.
    Returns the payload bytes sent; raises TransferError (caller releases its pins either way)."""
    header = HandoffHeader(request_id, num_tokens, len(block_ids), kv.layout)
    index = torch.tensor(list(block_ids), dtype=torch.int64)
    sent_bytes = 0
    for rank in target.ranks:
        transport.send(rank.peer_id, header.encode(), call_timeout_s(target.lease_deadline_s))
        heads = (rank.kv_head_start, rank.kv_head_end)
        first = kv.export_layer(0, *heads, index)
        for group in layer_groups(kv.num_layers, sum(t.nbytes for t in first)):
            payload = [t for i in group for t in (first if i == 0 else kv.export_layer(i, *heads, index))]
            sent_bytes += transport.send(rank.peer_id, payload, call_timeout_s(target.lease_deadline_s)).num_bytes
    # Acks after all sends, so ranks copy in parallel with later sends. Every rank's ack is read even
    # after one failed: an unread ack would be taken by the next hand-off to that rank for its own.
    failure: TransferError | None = None
    for rank in target.ranks:
        ack = torch.zeros(1, dtype=torch.int64)
        try:
            transport.recv(rank.peer_id, [ack], call_timeout_s(target.lease_deadline_s))
        except TransferError as err:  # the transport reset this channel: nothing of it is left to read
            failure = failure or err
            continue
        if int(ack[0]) != ACK_OK:
            failure = failure or TransferError(rank.peer_id, f"decode rank refused the KV of {request_id!r}")
    if failure is not None:
        raise failure
    return sent_bytes


def recv_header(transport: KVTransport, peer: PeerId, deadline_s: float) -> HandoffHeader:
    buffers = HandoffHeader.buffers()
    transport.recv(peer, buffers, call_timeout_s(deadline_s))
    return HandoffHeader.decode(buffers)


def recv_sequence_kv(
    transport: KVTransport,
    kv: KVCacheStorage,
    peer: PeerId,
    header: HandoffHeader,
    block_ids: Sequence[int],
    deadline_s: float,
) -> None:
    """Decode rank side, after `recv_header` (and the layout check): receive every layer into the
    reserved blocks, then ack. `kv` is this rank's cache (its own KV heads)."""
    if header.num_blocks != len(block_ids):
        raise TransferError(
            peer, f"{header.request_id!r}: sender has {header.num_blocks} blocks, the reservation {len(block_ids)}"
        )
    index = torch.tensor(list(block_ids), dtype=torch.int64)
    for group, buffers in message_staging(kv, len(block_ids)):
        transport.recv(peer, buffers, call_timeout_s(deadline_s))
        per_layer = len(buffers) // len(group)
        for j, layer in enumerate(group):
            kv.import_layer(layer, index, buffers[j * per_layer : (j + 1) * per_layer])
    transport.send(peer, [torch.tensor([ACK_OK], dtype=torch.int64)], call_timeout_s(deadline_s))
