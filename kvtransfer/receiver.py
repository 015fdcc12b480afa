"""The receiving side of a KV hand-off: which transfers a worker expects, and receiving them.

Two users. A decode rank: rank 0 reserves blocks for a request and registers the expectation on every
rank (`expect`); the prefill worker, right before it sends, asks each rank to `receive` (so no rank
ever blocks on an idle channel). A prefill worker pulling a cached prefix from a peer: it reserves
blocks for the prefix and expects them with `allow_fewer_blocks` (the holder may have lost some of
the tail since the router looked; the header says how many come). A transfer is accepted only while
its expectation is pending and its lease has time left;
one that arrives for a cancelled or unknown request is drained into scratch space and refused, so
blocks that may already belong to another sequence are never written. `cancel` waits for a receive
in progress to end, which is what lets rank 0 free a reservation safely.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.kv_storage import KVCacheStorage
from kvtransfer.handoff import (
    HandoffHeader,
    call_timeout_s,
    layout_mismatch,
    message_staging,
    recv_header,
    recv_sequence_kv,
)
from kvtransfer.transport import KVTransport, PeerId, TransferError

REFUSED_DEADLINE_S = 10.0  # how long a refused transfer may take to drain
PEER_WAIT_S = 120.0  # bound on waiting for the previous conversation with the same peer


class TransferState(enum.Enum):
    PENDING = "pending"
    RECEIVING = "receiving"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class Expected:
    block_ids: tuple[int, ...]
    deadline_s: float  # time.time() lease end
    allow_fewer_blocks: bool = False  # accept a header naming fewer blocks (the leading ones)
    num_blocks_received: int = 0
    state: TransferState = TransferState.PENDING
    error: str | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class KVReceiver:
    """`kv` is this worker's (rank's) cache; transfers are written through its transfer methods only."""

    def __init__(self, transport: KVTransport, kv: KVCacheStorage):
        self.transport = transport
        self.kv = kv
        self._expected: dict[str, Expected] = {}
        self._lock = threading.Lock()
        self._peer_locks: dict[PeerId, threading.Lock] = {}
        self.delay_s = 0.0  # fault injection for tests: stall before receiving

    def expect(
        self, request_id: str, block_ids: tuple[int, ...], deadline_s: float, *, allow_fewer_blocks: bool = False
    ) -> None:
        with self._lock:
            self._expected[request_id] = Expected(tuple(block_ids), deadline_s, allow_fewer_blocks)

    def receive(self, peer: PeerId, request_id: str) -> None:
        """Blocking: receive one hand-off from `peer` (announced for `request_id`). Raises
        TransferError if it failed; a refused transfer (cancelled, unknown, lease over, or not fitting
        the reservation) is drained and nacked, so the channel never keeps a stale message."""
        lock = self._peer_lock(peer)
        # One conversation per peer at a time, in announce order (the sender announces the next one only
        # after this one's ack). The one before is bounded by its own deadline plus transport timeouts.
        if not lock.acquire(timeout=PEER_WAIT_S):
            raise TransferError(peer, f"a receive from this peer still runs after {PEER_WAIT_S:.0f} s")
        try:
            self._receive(peer, request_id)
        finally:
            lock.release()

    def _receive(self, peer: PeerId, request_id: str) -> None:
        with self._lock:
            entry = self._expected.get(request_id)
            if entry is not None and not (entry.state is TransferState.PENDING and time.time() < entry.deadline_s):
                entry = None  # cancelled, already receiving, or its lease is over: refused below
            accepted = entry is not None
            if entry is not None:
                entry.state = TransferState.RECEIVING
        deadline_s = entry.deadline_s if entry is not None else time.time() + REFUSED_DEADLINE_S
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            header = recv_header(self.transport, peer, deadline_s)
            mismatch = layout_mismatch(f"sender {peer!r}", "this worker", header.kv_layout, self.kv.layout)
            if mismatch is not None:
                self._refuse_layout(peer, header, deadline_s)
                raise TransferError(peer, mismatch)
            block_ids, problem = self._fit(entry, request_id, header)
            if problem is not None:
                self._drain(peer, header, deadline_s)
                raise TransferError(peer, problem)
            recv_sequence_kv(self.transport, self.kv, peer, header, block_ids, deadline_s)
            assert entry is not None, "_fit refuses a transfer nobody expects"
            entry.num_blocks_received = len(block_ids)
            self._finish(request_id, TransferState.DONE, None)
        except TransferError as err:
            if accepted:
                self._finish(request_id, TransferState.FAILED, str(err))
            raise

    @staticmethod
    def _fit(entry: Expected | None, request_id: str, header: HandoffHeader) -> tuple[tuple[int, ...], str | None]:
        """The blocks this header's KV goes into, or why it is refused."""
        if header.request_id != request_id:
            return (), f"announced {request_id!r} but the header names {header.request_id!r}"
        if entry is None:
            return (), f"{request_id!r} is not expected here (cancelled or lease over)"
        fewer = entry.allow_fewer_blocks and 0 < header.num_blocks <= len(entry.block_ids)
        if header.num_blocks != len(entry.block_ids) and not fewer:
            return (), (
                f"{request_id!r}: sender has {header.num_blocks} blocks, the reservation {len(entry.block_ids)}"
            )
        return entry.block_ids[: header.num_blocks], None

    def _peer_lock(self, peer: PeerId) -> threading.Lock:
        with self._lock:
            return self._peer_locks.setdefault(peer, threading.Lock())

    def wait(self, request_id: str, timeout_s: float) -> int:
        """Until this worker has the request's KV; returns the blocks received (the leading ones of the
        reservation); raises TransferError otherwise."""
        entry = self._get(request_id)
        if not entry.finished.wait(timeout_s):
            raise TransferError("-", f"KV of {request_id!r} not received within {timeout_s:.1f} s")
        if entry.state is not TransferState.DONE:
            raise TransferError("-", entry.error or f"KV of {request_id!r} was {entry.state.value}")
        return entry.num_blocks_received

    def cancel(self, request_id: str, timeout_s: float) -> None:
        """Stop accepting the request's KV; returns once no receive can write its blocks."""
        with self._lock:
            entry = self._expected.get(request_id)
            if entry is None:
                return
            if entry.state is TransferState.PENDING:
                entry.state = TransferState.CANCELLED
                entry.finished.set()
        if entry.state is TransferState.RECEIVING and not entry.finished.wait(timeout_s):
            raise TimeoutError(f"receive of {request_id!r} still running after {timeout_s:.1f} s")

    @property
    def num_expected(self) -> int:
        """Transfers registered and not forgotten yet (a leak check: 0 when idle)."""
        with self._lock:
            return len(self._expected)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._expected.pop(request_id, None)

    def _get(self, request_id: str) -> Expected:
        with self._lock:
            entry = self._expected.get(request_id)
        if entry is None:
            raise TransferError("-", f"no KV hand-off expected for {request_id!r}")
        return entry

    def _finish(self, request_id: str, state: TransferState, error: str | None) -> None:
        with self._lock:
            entry = self._expected.get(request_id)
            if entry is not None:
                entry.state, entry.error = state, error
                entry.finished.set()

    def _drain(self, peer: PeerId, header: HandoffHeader, deadline_s: float) -> None:
        for _, scratch in message_staging(self.kv, header.num_blocks):
            self.transport.recv(peer, scratch, call_timeout_s(deadline_s))
        self.transport.send(peer, [torch.tensor([0], dtype=torch.int64)], call_timeout_s(deadline_s))

    def _refuse_layout(self, peer: PeerId, header: HandoffHeader, deadline_s: float) -> None:
        """The sender's layer messages do not fit our staging tensors, so they cannot be drained: posting
        one receive makes the transport compare layouts and fail the channel on both sides (contract
        point 1), so the sender stops at once instead of at its timeout."""
        messages = message_staging(self.kv, header.num_blocks)
        try:
            self.transport.recv(peer, messages[0][1], call_timeout_s(deadline_s))
        except TransferError:
            return
        # Same tensors under another name (a layout this check does not know): take the rest, refuse.
        for _, scratch in messages[1:]:
            self.transport.recv(peer, scratch, call_timeout_s(deadline_s))
        self.transport.send(peer, [torch.tensor([0], dtype=torch.int64)], call_timeout_s(deadline_s))
