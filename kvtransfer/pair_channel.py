"""One live pair group between two workers, and the framing of every message it carries.

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

import datetime
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer import cuda_ipc
from kvtransfer.transport import MessageLayout

_MAGIC = 0x4B5654524E535031  # "KVTRNSP1": catches a peer speaking another protocol version
_GLOO_CHUNK_BYTES = 4 << 20
MIN_WAIT_S = 0.001  # Work.wait(timedelta(0)) would mean "no timeout": never pass zero
LOST = "connection lost: "  # prefix of errors after which a call may follow a cleanly closing peer
_DATA, _ACK = 0, 1  # tags: acks never match a data message, whatever the interleaving


@dataclass
class PairChannel:
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


def _post_and_wait(
    channel: PairChannel, posts: list[tuple[str, torch.Tensor, int]], deadline_s: float, works: list[Any] | None = None
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
            remaining_s = max(deadline_s - time.monotonic(), MIN_WAIT_S)  # a finished work returns at once
            work.wait(datetime.timedelta(seconds=remaining_s))
    except RuntimeError as exc:
        # First line only, without gloo's "[/path/to/pair.cc:553] " source location prefix.
        text = re.sub(r"^\[[^\]]*\]\s*", "", (str(exc) or type(exc).__name__).splitlines()[0])[:200]
        return f"timed out waiting for the peer ({text})" if "timed out" in text.lower() else LOST + text
    finally:
        works.clear()
    return None


def _copy_from_peer(records: torch.Tensor, staged: list[torch.Tensor]) -> str | None:
    """cuda_ipc: copy the sender's tensors (mapped from their IPC handles) into ``staged``."""
    try:
        cuda_ipc.copy_from_handles(records, staged)
    except (RuntimeError, ValueError) as exc:  # the sender's memory could not be mapped or read
        return LOST + f"CUDA IPC copy failed: {str(exc).splitlines()[0][:200]}"
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
