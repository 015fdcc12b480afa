"""The KV hand-off protocol: how one sequence's prompt KV moves from a prefill worker to the ranks of a
decode instance, on top of any `KVTransport`.

Lifecycle of one hand-off (every step bounded by the lease deadline):
1. Reservation: the decode instance allocates `block_ids` for the sequence (on every TP rank the same
   ids) and registers an `ExpectedTransfer` naming the prefill peer, before the prefill starts.
2. The prefill worker computes the prompt, samples the first token, pins the blocks, and for each
   decode rank sends: a header (request id, token and block counts), then one message per layer with
   that rank's KV heads of the sequence's blocks, `[2 (K/V), kv_heads_of_rank, num_blocks, block, dim]`.
   Per-layer messages let the receiver copy layer i into its cache while layer i+1 is on the wire.
3. Each decode rank receives into staging buffers, copies into its reserved blocks, and sends an ack.
4. The prefill side releases its pins after every rank's ack (or when the lease ends, whatever
   happened). A decode rank that loses its peer frees nothing itself: it reports the failure, and the
   instance frees the reservation and fails the request with the reason.

Cache layout on both sides: `[num_layers, 2, kv_heads, num_blocks, block_size, head_dim]` (the engine's).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from kvtransfer.transport import KVTransport, PeerId, TransferError

REQUEST_ID_BYTES = 128  # request ids are utf-8, at most this long on the wire
ACK_OK = 1
CONVERSATION_GRACE_S = 2.0  # a started hand-off's calls may outlive its lease by this much


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


@dataclass(frozen=True)
class HandoffHeader:
    request_id: str
    num_tokens: int  # tokens of KV carried (the prompt)
    num_blocks: int

    def encode(self) -> list[torch.Tensor]:
        raw = self.request_id.encode()
        if len(raw) > REQUEST_ID_BYTES:
            raise ValueError(f"request id longer than {REQUEST_ID_BYTES} bytes cannot be handed off")
        name = torch.zeros(REQUEST_ID_BYTES, dtype=torch.uint8)
        name[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return [torch.tensor([len(raw), self.num_tokens, self.num_blocks], dtype=torch.int64), name]

    @staticmethod
    def buffers() -> list[torch.Tensor]:
        return [torch.zeros(3, dtype=torch.int64), torch.zeros(REQUEST_ID_BYTES, dtype=torch.uint8)]

    @classmethod
    def decode(cls, buffers: list[torch.Tensor]) -> "HandoffHeader":
        length, num_tokens, num_blocks = (int(v) for v in buffers[0])
        request_id = bytes(buffers[1][:length].tolist()).decode()
        return cls(request_id, num_tokens, num_blocks)


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


def send_sequence_kv(transport: KVTransport, kv_cache: torch.Tensor, block_ids: Sequence[int],
                     num_tokens: int, request_id: str, target: HandoffTarget) -> int:
    """Prefill side: send one sequence's KV to every rank of the target and collect their acks.
    Returns the payload bytes sent; raises TransferError (caller releases its pins either way)."""
    header = HandoffHeader(request_id, num_tokens, len(block_ids))
    index = torch.tensor(list(block_ids), dtype=torch.int64)
    sent_bytes = 0
    for rank in target.ranks:
        transport.send(rank.peer_id, header.encode(), call_timeout_s(target.lease_deadline_s))
        for layer in range(kv_cache.shape[0]):
            heads = kv_cache[layer, :, rank.kv_head_start:rank.kv_head_end]
            payload = heads.index_select(2, index)  # [2, heads, blocks, block_size, head_dim]
            sent_bytes += transport.send(rank.peer_id, [payload], call_timeout_s(target.lease_deadline_s)).num_bytes
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


def recv_sequence_kv(transport: KVTransport, kv_cache: torch.Tensor, peer: PeerId, header: HandoffHeader,
                     block_ids: Sequence[int], deadline_s: float) -> None:
    """Decode rank side, after `recv_header`: receive every layer into the reserved blocks, then ack.
    `kv_cache` is this rank's cache (its own KV heads)."""
    if header.num_blocks != len(block_ids):
        raise TransferError(peer, f"{header.request_id!r}: sender has {header.num_blocks} blocks, "
                                  f"the reservation {len(block_ids)}")
    num_layers, _, heads, _, block_size, head_dim = kv_cache.shape
    index = torch.tensor(list(block_ids), dtype=torch.int64)
    staging = torch.empty(2, heads, len(block_ids), block_size, head_dim, dtype=kv_cache.dtype)
    for layer in range(num_layers):
        transport.recv(peer, [staging], call_timeout_s(deadline_s))
        kv_cache[layer].index_copy_(2, index, staging)
    transport.send(peer, [torch.tensor([ACK_OK], dtype=torch.int64)], call_timeout_s(deadline_s))
