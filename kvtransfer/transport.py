"""The KV transport interface: moving lists of tensors between two worker processes.

The transport knows nothing about models, blocks or sequences: it moves an ordered list of tensors
from one process to another. The hand-off protocol (descriptor, reservation, lease, ack) is built on
top of it and owns everything above "these bytes arrived" / "this channel broke".
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import torch

PeerId = str
"""Stable worker id, e.g. ``"prefill-0"`` or ``"decode-1/rank0"``; the same string in every process."""


class TransferStats(NamedTuple):
    """What one completed send or recv moved."""

    num_bytes: int  # payload bytes (sum of tensor sizes), framing excluded
    elapsed_s: float  # wall time of the whole call, channel (re)creation included


class MessageLayout(NamedTuple):
    """What both sides of one message must agree on (contract point 1), from the tensors alone.

    Implementations send it (or its digest) ahead of the payload so that the receiver can refuse a
    message that does not fit its ``out`` tensors before writing any of them.
    """

    num_tensors: int
    num_bytes: int
    digest: int  # signed 64-bit blake2b of ``description``: identical in every process and host
    description: str  # e.g. "[float32[2, 3], bfloat16[4]]", for error messages

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> MessageLayout:
        parts = (f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors)
        description = "[" + ", ".join(parts) + "]"
        digest = int.from_bytes(hashlib.blake2b(description.encode(), digest_size=8).digest(), "little", signed=True)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors)
        return cls(len(tensors), num_bytes, digest, description)

    def mismatch(self, sent: MessageLayout) -> str | None:
        """Why a message with layout ``sent`` (description may be unknown) cannot fill ours, or None."""
        if (sent.num_tensors, sent.num_bytes, sent.digest) == (self.num_tensors, self.num_bytes, self.digest):
            return None
        return (
            f"layout mismatch: the sender sent {sent.num_tensors} tensors / {sent.num_bytes} bytes "
            f"(digest {sent.digest:#x}); the receiver expected {self.num_tensors} tensors / "
            f"{self.num_bytes} bytes {self.description}"
        )


class TransferError(Exception):
    """A send or recv with ``peer`` did not complete; ``reason`` says why.

    Raised on timeout, on peer failure (process died, channel reset by the peer), and on protocol
    mismatch (the two sides disagree on the count, shapes or dtypes of the tensors). Once raised,
    the channel with that peer has been torn down (see ``KVTransport``).
    """

    def __init__(self, peer: PeerId, reason: str) -> None:
        super().__init__(f"KV transfer with peer {peer!r} failed: {reason}")
        self.peer = peer
        self.reason = reason

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields intact
        return (type(self), (self.peer, self.reason))


class PeerGone(TransferError):
    """The call's peer left the cluster (``forget_peer``): nothing can ever reach it again."""


class KVTransport(ABC):
    """Point-to-point transport of tensor lists between named workers.

    Contract (every implementation; ``tests/kvtransfer/test_transport_contract.py`` checks it):

    1. **Matching.** ``send(peer, tensors)`` in process A matches ``recv(a_id, out)`` in process B.
       Both sides must pass the same number of tensors, with identical shapes and dtypes, in the
       same order. A mismatch is detected before any payload is written and raises
       ``TransferError`` on both sides (the receiver names the difference).
    2. **Ordering.** Messages between a (sender, receiver) pair arrive in the order they were sent;
       the i-th successful ``recv`` from a peer returns the i-th message that peer sent to us.
       Each direction of a pair is an independent ordered stream.
    3. **Ownership.** ``send`` only reads ``tensors`` and does not keep them after it returns.
       ``recv`` writes in place into the caller-owned ``out`` tensors and keeps no reference after
       it returns; on ``TransferError`` their contents are unspecified (possibly partly written).
       Non-contiguous tensors are accepted on both sides (staged through a contiguous copy).
    4. **Completion.** ``recv`` returning means every ``out`` tensor holds the sent bytes, bitwise.
       ``send`` returning means the peer's matching ``recv`` has received every byte (not that the
       peer has processed them: acks of that kind belong to the protocol above). A ``send`` that
       raises may still have been delivered (e.g. the receiver died right after receiving), so
       the protocol above must make re-sending a message harmless. Every call waits for its
       matching call, so two sides that both ``send`` to each other at the same time wait for
       each other until the timeout: a pair's conversation must alternate or be one-way.
    5. **Timeouts.** Both calls raise ``TransferError`` if the whole call (including lazy channel
       creation) has not completed within ``timeout_s`` plus a small slack (well under a second);
       neither ever blocks longer. A peer that never posts the matching call is a timeout.
    6. **Failure.** A peer process that dies makes a pending or later call with it raise
       ``TransferError`` (promptly when the OS reports the closed connection, else at the timeout),
       never hang. After any ``TransferError`` with a peer, the channel with that peer is torn down
       on this side and marked broken for the other side: the peer's pending or next call on the
       old channel raises ``TransferError`` too, so both sides learn of every failure and a message
       is never silently dropped from the middle of a stream. The next call after that
       transparently creates a fresh channel; messages in flight when it broke are lost (the
       protocol above retries whole hand-offs).
    7. **Closing.** ``close_peer(peer)`` tears down the channel with ``peer`` cleanly; it is not a
       failure: the peer follows to a fresh channel without an error, on its next call or from the
       call it has pending at that moment (nothing of which was delivered yet, as ``close_peer``
       does not race with our own calls to that peer). ``close()`` closes every channel; the
       transport is unusable afterwards. Both are idempotent and never block long. ``forget_peer(peer)``
       is for a peer known to be dead (peer ids are never reused): it releases an idle channel at once
       (so a dead peer's pair group does not linger), never races with a call in flight, and never
       blocks; every later call with the peer raises ``PeerGone`` at once, and so does a call in flight
       still waiting for the peer to open a channel (instead of waiting out its timeout).
    8. **Threads.** Calls for different peers may run concurrently from different threads. Calls
       for the same peer must be serialized by the caller (at most one in-flight ``send`` or
       ``recv`` per peer on this side); a concurrent second call for the same peer raises
       ``RuntimeError``. ``close_peer`` / ``close`` must not race with a call for the same peer.
    9. **Resources.** An implementation may bound the number of open channels; evicting a channel
       is a ``close_peer`` and therefore invisible to both sides apart from re-creation cost.
    """

    local_id: PeerId

    @abstractmethod
    def send(self, peer: PeerId, tensors: Sequence[torch.Tensor], timeout_s: float) -> TransferStats:
        """Send ``tensors`` (in order) to ``peer``; blocks until the peer received them; see the contract."""

    @abstractmethod
    def recv(self, peer: PeerId, out: Sequence[torch.Tensor], timeout_s: float) -> TransferStats:
        """Receive the next message from ``peer`` into ``out`` (in place); see the contract."""

    @abstractmethod
    def close_peer(self, peer: PeerId) -> None:
        """Tear down the channel with ``peer`` (no-op if none); the next call re-creates it."""

    @abstractmethod
    def forget_peer(self, peer: PeerId) -> bool:
        """``peer`` left the cluster (its process is gone): close its channel now unless a call with it is
        in flight (that call fails on its own and discards the channel); later calls with it raise
        ``PeerGone``. Safe from any thread at any time, unlike ``close_peer``. Returns whether a channel
        was closed."""

    @abstractmethod
    def close(self) -> None:
        """Tear down every channel (each closed cleanly, as by ``close_peer``); later calls raise."""
