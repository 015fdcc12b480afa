"""The receiving side of a KV hand-off: which transfers a worker expects, and receiving them.

Two users. A decode rank: rank 0 reserves blocks for a request and registers the expectation on every
rank (`expect`); the prefill worker, right before it sends, asks each rank to `receive` (so no rank
ever blocks on an idle channel). A prefill worker pulling a cached prefix from a peer: it reserves
blocks for the prefix and expects them with `allow_fewer_blocks` (the holder may have lost some of
the tail since the router looked; the header says how many come). A transfer is accepted only while its expectation is pending and its lease has time left;
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

from kvtransfer.handoff import HandoffHeader, recv_header, recv_sequence_kv, remaining_s
from kvtransfer.transport import KVTransport, PeerId, TransferError


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
    def __init__(self, transport: KVTransport, kv_cache: torch.Tensor):
        self.transport = transport
        self.kv_cache = kv_cache
        self._expected: dict[str, Expected] = {}
        self._lock = threading.Lock()
        self.delay_s = 0.0  # fault injection for tests: stall before receiving

    def expect(self, request_id: str, block_ids: tuple[int, ...], deadline_s: float, *,
               allow_fewer_blocks: bool = False) -> None:
        with self._lock:
            self._expected[request_id] = Expected(tuple(block_ids), deadline_s, allow_fewer_blocks)

    def receive(self, peer: PeerId, request_id: str) -> None:
        """Blocking: receive one hand-off from `peer` (announced for `request_id`). Raises
        TransferError if it failed; a refused (cancelled/unknown) transfer is drained and nacked."""
        with self._lock:
            entry = self._expected.get(request_id)
            accepted = entry is not None and entry.state is TransferState.PENDING and time.time() < entry.deadline_s
            if accepted:
                entry.state = TransferState.RECEIVING
        deadline_s = entry.deadline_s if accepted else time.time() + 10.0
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            header = recv_header(self.transport, peer, deadline_s)
            if header.request_id != request_id:
                raise TransferError(peer, f"announced {request_id!r} but the header names {header.request_id!r}")
            if not accepted:
                self._drain(peer, header, deadline_s)
                raise TransferError(peer, f"{request_id!r} is not expected here (cancelled or lease over)")
            block_ids = entry.block_ids
            if entry.allow_fewer_blocks and 0 < header.num_blocks <= len(block_ids):
                block_ids = block_ids[:header.num_blocks]
            recv_sequence_kv(self.transport, self.kv_cache, peer, header, block_ids, deadline_s)
            entry.num_blocks_received = len(block_ids)
            self._finish(request_id, TransferState.DONE, None)
        except TransferError as err:
            if accepted:
                self._finish(request_id, TransferState.FAILED, str(err))
            raise

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
        _, _, heads, _, block_size, head_dim = self.kv_cache.shape
        scratch = torch.empty(2, heads, header.num_blocks, block_size, head_dim, dtype=self.kv_cache.dtype)
        for _ in range(self.kv_cache.shape[0]):
            self.transport.recv(peer, [scratch], remaining_s(deadline_s))
        self.transport.send(peer, [torch.tensor([0], dtype=torch.int64)], remaining_s(deadline_s))
