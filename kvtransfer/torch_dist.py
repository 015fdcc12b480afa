"""``KVTransport`` over torch.distributed: one lazily built 2-rank process group per worker pair.

Pair groups, not one world group: workers come and go and pair up dynamically; a 2-rank gloo / NCCL
group needs no cluster-wide collective, builds in 1-2 ms (gloo), and many coexist in one process.
How two workers meet, generation after generation, lives in ``kvtransfer.store``; how one pair's
channel frames and moves each message, in ``kvtransfer.pair_channel``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch.distributed import DistError

from kvtransfer.pair_channel import LOST, MIN_WAIT_S, PairChannel
from kvtransfer.store import PairRendezvous, connect_store
from kvtransfer.transport import KVTransport, MessageLayout, PeerGone, PeerId, TransferError, TransferStats

_MAX_ATTEMPTS = 3  # a call follows a cleanly closing peer to a new channel at most this often
# "auto": gloo for CPU tensors; for CUDA tensors cuda_ipc when both sides sit on the same GPU (NCCL
# refuses two ranks on one device), else nccl. The handshake compares the GPUs (kvtransfer.store).
_BACKENDS = ("auto", "gloo", "nccl", "cuda_ipc")


class TorchDistTransport(KVTransport):
    """``KVTransport`` over per-pair gloo / NCCL process groups (contract: ``KVTransport``).

    ``backend``: "gloo", "nccl", or "auto" (nccl for CUDA tensors, else gloo; the two sides' choices
    are compared when a channel opens). ``max_pairs`` bounds open channels: beyond it the least
    recently used idle one is closed cleanly. ``connect_timeout_s`` bounds store requests and
    channel creation; each call's ``timeout_s`` bounds the whole call further.
    """

    def __init__(
        self,
        local_id: PeerId,
        store_host: str,
        store_port: int,
        *,
        backend: str = "auto",
        max_pairs: int = 16,
        connect_timeout_s: float = 30.0,
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; known: {', '.join(_BACKENDS)}")
        if max_pairs < 1 or connect_timeout_s <= 0:
            raise ValueError(f"need max_pairs >= 1 and connect_timeout_s > 0, got {max_pairs}, {connect_timeout_s}")
        self.local_id = local_id
        self._backend, self._max_pairs, self._connect_timeout_s = backend, max_pairs, connect_timeout_s
        self._store = connect_store(store_host, store_port, connect_timeout_s)
        self._lock = threading.Lock()  # guards the four fields below; never held while blocking
        self._channels: OrderedDict[PeerId, PairChannel] = OrderedDict()  # least recently used first
        self._busy: set[PeerId] = set()
        self._gone: set[PeerId] = set()  # forgotten peers: they left the cluster (ids are never reused)
        self._closed = False

    def send(self, peer: PeerId, tensors: Sequence[torch.Tensor], timeout_s: float) -> TransferStats:
        return self._call(peer, "send", list(tensors), timeout_s)

    def recv(self, peer: PeerId, out: Sequence[torch.Tensor], timeout_s: float) -> TransferStats:
        return self._call(peer, "recv", list(out), timeout_s)

    def close_peer(self, peer: PeerId) -> None:
        with self._lock:
            channel = self._channels.pop(peer, None)
        if channel is not None:
            self._retire(peer, channel)

    def forget_peer(self, peer: PeerId) -> bool:
        with self._lock:
            self._gone.add(peer)
            if peer in self._busy or peer not in self._channels:
                return False
            channel = self._channels.pop(peer)
        self._retire(peer, channel)
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.items()), OrderedDict()
        for peer, channel in channels:
            self._retire(peer, channel)

    def _call(self, peer: PeerId, op: str, tensors: list[torch.Tensor], timeout_s: float) -> TransferStats:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        layout, devices = MessageLayout.of(tensors), {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"the tensors of one message must share a device, got {sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cpu")
        start_s = time.monotonic()
        if peer in self._gone:
            raise PeerGone(peer, "the peer left the cluster")
        self._acquire(peer)
        try:
            rendezvous = PairRendezvous(self._store, self.local_id, peer)
            for _ in range(_MAX_ATTEMPTS):
                channel = self._channel_for(peer, rendezvous, device, start_s + timeout_s)
                move = channel.send_message if op == "send" else channel.recv_message
                error = move(tensors, layout, start_s + timeout_s)
                if error is None:
                    return TransferStats(num_bytes=layout.num_bytes, elapsed_s=time.monotonic() - start_s)
                self._handle_failure(peer, rendezvous, channel, error)
            raise TransferError(peer, f"the peer re-created the channel {_MAX_ATTEMPTS} times during one call")
        except DistError as exc:  # the rendezvous store itself failed: a cluster problem, same contract
            raise TransferError(peer, f"rendezvous store failed: {exc}") from None
        finally:
            with self._lock:
                self._busy.discard(peer)

    def _handle_failure(self, peer: PeerId, rendezvous: PairRendezvous, channel: PairChannel, error: str) -> None:
        """Decide what a failed exchange means; returns only if the call should follow the peer."""
        peer_moved = rendezvous.current_generation() > channel.generation
        peer_reason = rendezvous.failure_reason(channel.generation) if peer_moved else None
        # The peer closed cleanly while nothing of this call was delivered: follow it, no error.
        followed = peer_moved and peer_reason is None and error.startswith(LOST)
        if not followed and peer_reason is None:
            # We detected it: say why before our sockets close, so the peer can tell failure from close.
            rendezvous.mark_failed(channel.generation, f"{self.local_id}: {error}")
        self._discard(peer, channel)
        if not followed:
            raise TransferError(peer, error if peer_reason is None else f"the peer reset the channel: {peer_reason}")

    def _channel_for(
        self, peer: PeerId, rendezvous: PairRendezvous, device: torch.device, deadline_s: float
    ) -> PairChannel:
        """The channel with ``peer``, checked to still be the pair's newest generation, or a new one."""
        backend = self._backend if self._backend != "auto" else ("cuda" if device.type == "cuda" else "gloo")
        with self._lock:
            if (channel := self._channels.get(peer)) is not None:
                self._channels.move_to_end(peer)
        if channel is not None and (channel.requested, channel.device) != (backend, device):
            self.close_peer(peer)  # other device: the peer follows as after any clean close
            channel = None
        # gloo reports a peer's close on the socket itself (see _handle_failure); NCCL asks the store.
        if channel is not None and channel.backend == "nccl" and rendezvous.current_generation() > channel.generation:
            self._discard(peer, channel)
            reason = rendezvous.failure_reason(channel.generation)
            if reason is not None:  # the message this call expects may be lost: say so, once
                raise TransferError(peer, f"the peer reset the channel: {reason}")
            channel = None
        return channel or self._join(peer, rendezvous, backend, device, deadline_s)

    def _join(
        self, peer: PeerId, rendezvous: PairRendezvous, backend: str, device: torch.device, deadline_s: float
    ) -> PairChannel:
        """Open a channel of the pair's newest fresh generation (protocol steps in kvtransfer.store)."""
        generation = rendezvous.join()
        timeout_s = min(self._connect_timeout_s, max(deadline_s - time.monotonic(), MIN_WAIT_S))
        try:
            agreed = rendezvous.handshake(generation, backend, timeout_s, _gpu_id(device), lambda: peer in self._gone)
            group = rendezvous.create_group(generation, agreed, max(deadline_s - time.monotonic(), MIN_WAIT_S))
        except RuntimeError as exc:  # store timeout, gloo / nccl rendezvous errors: all mean "no channel"
            reason = f"could not open channel generation {generation} within {timeout_s:.1f} s: {exc}"
            rendezvous.mark_failed(generation, f"{self.local_id}: {reason}")
            if peer in self._gone:  # forgotten while we waited for it
                raise PeerGone(peer, "the peer left the cluster while the channel was opening") from None
            raise TransferError(peer, reason) from None
        return self._insert(peer, PairChannel(generation, backend, agreed, device, 1 - rendezvous.rank, group))

    def _insert(self, peer: PeerId, channel: PairChannel) -> PairChannel:
        """Add ``channel`` to the pool, closing least recently used idle channels beyond ``max_pairs``."""
        evicted = []
        with self._lock:
            self._channels[peer] = channel
            idle = [p for p in self._channels if p not in self._busy]
            while len(self._channels) > self._max_pairs and idle:
                evicted.append((idle[0], self._channels.pop(idle.pop(0))))
        for victim, old in evicted:
            self._retire(victim, old)
        return channel

    def _discard(self, peer: PeerId, channel: PairChannel) -> None:
        """Tear down ``channel`` on this side only (the pair's generation was retired already)."""
        with self._lock:
            if self._channels.get(peer) is channel:
                del self._channels[peer]
        channel.teardown()

    def _retire(self, peer: PeerId, channel: PairChannel) -> None:
        """Close ``channel`` cleanly: advance the generation first, so that the peer reads EOF as a close."""
        with contextlib.suppress(DistError):  # store gone: the peer will take our EOF for a failure
            PairRendezvous(self._store, self.local_id, peer).advance(channel.generation)
        channel.teardown()

    def _acquire(self, peer: PeerId) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"transport {self.local_id!r} is closed")
            if peer in self._busy:
                raise RuntimeError(f"a call with peer {peer!r} is already in flight (one per peer at a time)")
            self._busy.add(peer)


def _gpu_id(device: torch.device) -> str:
    """What tells two processes they share a GPU: its UUID (device indices differ across processes)."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
