"""``KVTransport`` over torch.distributed: one lazily built 2-rank process group per worker pair.

Pair groups, not one world group: workers come and go and pair up dynamically; a 2-rank gloo / NCCL
group needs no cluster-wide collective, builds in 1-2 ms (gloo), and many coexist in one process.
How two workers meet, generation after generation, lives in ``kvtransfer.store``.

A message (int64 framing): (1) header (magic, generation, sequence number, tensor count, bytes,
layout digest), checked before any payload buffer is posted: a count / shape / dtype mismatch or a
lost message fails both sides instead of corrupting ``out``; gloo receivers post the next header's
recv in advance, so it costs no extra round trip in a stream; (2) each tensor's bytes as uint8
views (any dtype, bit-exact), in 4 MiB chunks for gloo, all posted at once; (3) a trailer; (4) the
receiver's ack. Each side waits for its tiny last message first: gloo fails a pending op at once
when the connection drops, but not one whose bytes are moving, so a peer's death surfaces in
milliseconds, not at the timeout. Chunks, measured on the 2-core box at 64-256 MiB: idle, 1-4 MiB
chunks beat whole 8-256 MiB sends (3.1-4.4 vs 2.3-2.5 GB/s: both peers' IO threads pipeline);
with other jobs running, 4 MiB or whole tensors beat 1 MiB (2.2-2.6 vs 2.0-2.1 GB/s), hence 4 MiB.
Copying small tensors into one staging buffer lost to sending them one by one (the copies compete
for the cores): nothing is flattened; each tensor costs ~30-50 us of ops. NCCL sends tensors whole.
Two processes on one GPU (NCCL refuses that pair) use ``cuda_ipc``: a gloo channel carries the same
framing plus CUDA IPC handle records instead of the payload, and the receiver copies from the sender's
memory device-to-device before it acks (``kvtransfer.cuda_ipc``).
"""

from __future__ import annotations

import contextlib
import datetime
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import DistError

from kvtransfer import cuda_ipc
from kvtransfer.store import PairRendezvous, connect_store
from kvtransfer.transport import KVTransport, MessageLayout, PeerId, TransferError, TransferStats

_MAGIC = 0x4B5654524E535031  # "KVTRNSP1": catches a peer speaking another protocol version
_GLOO_CHUNK_BYTES = 4 << 20
_MIN_WAIT_S = 0.001  # Work.wait(timedelta(0)) would mean "no timeout": never pass zero
_MAX_ATTEMPTS = 3  # a call follows a cleanly closing peer to a new channel at most this often
# "auto": gloo for CPU tensors; for CUDA tensors cuda_ipc when both sides sit on the same GPU (NCCL
# refuses two ranks on one device), else nccl. The handshake compares the GPUs (kvtransfer.store).
_BACKENDS = ("auto", "gloo", "nccl", "cuda_ipc")
_LOST = "connection lost: "  # prefix of errors after which a call may follow a cleanly closing peer
_DATA, _ACK = 0, 1  # tags: acks never match a data message, whatever the interleaving


@dataclass
class _Channel:
    """One live pair group and its message counters; used by one call at a time."""

    generation: int
    requested: str  # what this side asked for ("cuda" for auto on a GPU); `backend` is what the pair agreed
    backend: str
    device: torch.device
    peer_rank: int
    group: Any  # ProcessGroupGloo | ProcessGroupNCCL; None once torn down
    messages_sent: int = 0
    messages_received: int = 0
    last_ack: Any = None  # our latest ack send: kept alive until a later message proves it arrived
    early_header: tuple[torch.Tensor, Any] | None = None  # gloo: next header's recv, posted in advance

    def send_message(self, tensors: list[torch.Tensor], layout: MessageLayout, deadline_s: float) -> str | None:
        """Header, payload, trailer out; the peer's ack in. None on success, else why it failed."""
        sequence, ack = self.messages_sent, self._ints([-1])
        header = self._ints([_MAGIC, self.generation, sequence, layout.num_tensors, layout.num_bytes, layout.digest])
        contiguous = [t.contiguous() for t in tensors]  # alive until the ack: cuda_ipc peers read them in place
        payload = _wire_buffers(contiguous, self.backend)
        data = [("send", b, _DATA) for b in (header, *payload, self._ints([sequence]))]
        error = _post_and_wait(self, [*data, ("recv", ack, _ACK)], deadline_s)
        if error is None and ack.item() != sequence:
            error = f"protocol violated: ack {ack.item()} for message #{sequence}"
        self.messages_sent += error is None
        return error

    def recv_message(self, out: list[torch.Tensor], layout: MessageLayout, deadline_s: float) -> str | None:
        """Header in and checked, then payload and trailer in, ack out. None on success, else why not."""
        sequence, trailer = self.messages_received, self._ints([-1])
        header, early = self.early_header or (self._ints([0] * 6), None)
        self.early_header, posted = None, early is not None
        error = _post_and_wait(self, [] if posted else [("recv", header, _DATA)], deadline_s, [early] if posted else [])
        if error is None and header[:3].tolist() != [_MAGIC, self.generation, sequence]:
            error = f"protocol violated: header {header[:3].tolist()}, expected {[_MAGIC, self.generation, sequence]}"
        num_tensors, num_bytes, digest = header[3:].tolist()
        error = error or layout.mismatch(MessageLayout(num_tensors, num_bytes, digest, description="?"))
        if error is not None:
            return error
        staged = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format) for t in out]
        records = cuda_ipc.handles_buffer(staged) if self.backend == "cuda_ipc" else None
        wire = _wire_buffers(staged, self.backend) if records is None else ([records] if records.numel() else [])
        error = _post_and_wait(self, [("recv", b, _DATA) for b in (*wire, trailer)], deadline_s)
        if error is None and trailer.item() != sequence:
            error = f"protocol violated: trailer {trailer.item()} for message #{sequence}"
        if error is None and records is not None:
            error = _copy_from_peer(records, staged)
        if error is not None:
            return error
        for target, buffer in zip(out, staged, strict=True):
            if target is not buffer:
                target.copy_(buffer)
        self.messages_received += 1
        # Not waited for: the sender's next message proves it arrived (a dead sender fails that).
        self.last_ack = self._post_quietly("send", self._ints([sequence]), _ACK)
        if self.backend != "nccl":  # saves a round trip per message; NCCL would block our sends behind it
            header = self._ints([0] * 6)
            work = self._post_quietly("recv", header, _DATA)
            self.early_header = (header, work) if work is not None else None
        return None

    def teardown(self) -> None:
        """Release the group. Its destructor (closes the sockets: the peer sees EOF) takes ~20 ms, GIL
        released, so a helper thread runs it; not a daemon: killed in it at exit, it aborts the process."""
        box, self.group, self.last_ack, self.early_header = [self.group], None, None, None
        if box[0] is not None and self.backend == "nccl":
            box[0].abort()  # a timed-out NCCL op would otherwise keep the communicator (and stream) busy
        threading.Thread(target=box.clear, name="kvpair-teardown").start()

    def _post_quietly(self, op: str, buffer: torch.Tensor, tag: int) -> Any:
        """Post without waiting; None if the pair already broke (the next call finds out)."""
        try:
            return (self.group.send if op == "send" else self.group.recv)([buffer], self.peer_rank, tag)
        except RuntimeError:
            return None

    def _ints(self, values: list[int]) -> torch.Tensor:
        # Framing travels where the group's tensors live: the GPU for NCCL, the host for gloo and cuda_ipc.
        return torch.tensor(values, dtype=torch.int64, device=self.device if self.backend == "nccl" else "cpu")


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
        self._lock = threading.Lock()  # guards the three fields below; never held while blocking
        self._channels: OrderedDict[PeerId, _Channel] = OrderedDict()  # least recently used first
        self._busy: set[PeerId] = set()
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

    def _handle_failure(self, peer: PeerId, rendezvous: PairRendezvous, channel: _Channel, error: str) -> None:
        """Decide what a failed exchange means; returns only if the call should follow the peer."""
        peer_moved = rendezvous.current_generation() > channel.generation
        peer_reason = rendezvous.failure_reason(channel.generation) if peer_moved else None
        # The peer closed cleanly while nothing of this call was delivered: follow it, no error.
        followed = peer_moved and peer_reason is None and error.startswith(_LOST)
        if not followed and peer_reason is None:
            # We detected it: say why before our sockets close, so the peer can tell failure from close.
            rendezvous.mark_failed(channel.generation, f"{self.local_id}: {error}")
        self._discard(peer, channel)
        if not followed:
            raise TransferError(peer, error if peer_reason is None else f"the peer reset the channel: {peer_reason}")

    def _channel_for(
        self, peer: PeerId, rendezvous: PairRendezvous, device: torch.device, deadline_s: float
    ) -> _Channel:
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
    ) -> _Channel:
        """Open a channel of the pair's newest fresh generation (protocol steps in kvtransfer.store)."""
        generation = rendezvous.join()
        timeout_s = min(self._connect_timeout_s, max(deadline_s - time.monotonic(), _MIN_WAIT_S))
        try:
            agreed = rendezvous.handshake(generation, backend, timeout_s, _gpu_id(device))
            group = rendezvous.create_group(generation, agreed, max(deadline_s - time.monotonic(), _MIN_WAIT_S))
        except RuntimeError as exc:  # store timeout, gloo / nccl rendezvous errors: all mean "no channel"
            reason = f"could not open channel generation {generation} within {timeout_s:.1f} s: {exc}"
            rendezvous.mark_failed(generation, f"{self.local_id}: {reason}")
            raise TransferError(peer, reason) from None
        return self._insert(peer, _Channel(generation, backend, agreed, device, 1 - rendezvous.rank, group))

    def _insert(self, peer: PeerId, channel: _Channel) -> _Channel:
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

    def _discard(self, peer: PeerId, channel: _Channel) -> None:
        """Tear down ``channel`` on this side only (the pair's generation was retired already)."""
        with self._lock:
            if self._channels.get(peer) is channel:
                del self._channels[peer]
        channel.teardown()

    def _retire(self, peer: PeerId, channel: _Channel) -> None:
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


def _post_and_wait(
    channel: _Channel, posts: list[tuple[str, torch.Tensor, int]], deadline_s: float, works: list[Any] | None = None
) -> str | None:
    """Post (op, buffer, tag) after the posted ``works``; wait for all, the last (tiny) one first (see
    module docstring; then all are done: one socket, FIFO). Returns why not, or None: no raise, so no
    traceback keeps the works (hence the sockets) alive after a failure; the peer must see EOF."""
    works = works or []
    try:
        for op, buffer, tag in posts:
            post = channel.group.send if op == "send" else channel.group.recv
            works.append(post([buffer], channel.peer_rank, tag))
        for work in reversed(works):
            remaining_s = max(deadline_s - time.monotonic(), _MIN_WAIT_S)  # a finished work returns at once
            work.wait(datetime.timedelta(seconds=remaining_s))
    except RuntimeError as exc:
        # First line only, without gloo's "[/path/to/pair.cc:553] " source location prefix.
        text = re.sub(r"^\[[^\]]*\]\s*", "", (str(exc) or type(exc).__name__).splitlines()[0])[:200]
        return f"timed out waiting for the peer ({text})" if "timed out" in text.lower() else _LOST + text
    finally:
        works.clear()
    return None


def _gpu_id(device: torch.device) -> str:
    """What tells two processes they share a GPU: its UUID (device indices differ across processes)."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def _copy_from_peer(records: torch.Tensor, staged: list[torch.Tensor]) -> str | None:
    """cuda_ipc: copy the sender's tensors (mapped from their IPC handles) into ``staged``."""
    try:
        cuda_ipc.copy_from_handles(records, staged)
    except (RuntimeError, ValueError) as exc:  # the sender's memory could not be mapped or read
        return _LOST + f"CUDA IPC copy failed: {str(exc).splitlines()[0][:200]}"
    return None


def _wire_buffers(tensors: list[torch.Tensor], backend: str) -> list[torch.Tensor]:
    """What goes on the wire for contiguous ``tensors``, in order: uint8 views (chunked for gloo), or
    for cuda_ipc one host buffer of IPC handle records (none when every tensor is empty)."""
    if backend == "cuda_ipc":
        records = cuda_ipc.export_handles(tensors)
        return [records] if records.numel() else []
    buffers: list[torch.Tensor] = []
    for tensor in tensors:
        if tensor.numel() == 0:
            continue  # both sides skip it: the header already proved they agree on the shape
        flat = tensor.reshape(-1).view(torch.uint8)
        buffers.extend(flat.split(_GLOO_CHUNK_BYTES) if backend == "gloo" else [flat])
    return buffers
