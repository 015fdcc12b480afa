"""Same-GPU payloads for the transport: CUDA IPC handles instead of bytes.

NCCL refuses two ranks on one device, and staging through host memory would cross PCIe twice. When
both sides of a pair sit on the same GPU (the prefill and decode workers of a one-GPU machine), the
sender exports a CUDA IPC handle for each tensor and sends only the handles (a few hundred bytes per
tensor, over the pair's gloo channel); the receiver maps the sender's memory and copies it into its
own tensors device-to-device, then acks. The sender keeps its tensors alive until that ack, so the
mapped memory is valid for the whole copy; PyTorch's IPC reference counting keeps a freed block out
of reuse until the receiver has dropped its mapping too.

Record per tensor (JSON in a fixed `RECORD_BYTES` slot, so the receiver knows the buffer size from
the layout alone): the storage's IPC handle, size and offset in its allocation, the reference
counter and event handles PyTorch's sharing needs, and the tensor's byte offset and length. The
event makes the receiver's copy wait for the sender's writes to the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

RECORD_BYTES = 1024


def export_handles(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One record per non-empty contiguous CUDA tensor, as a host uint8 buffer `[count * RECORD_BYTES]`.
    The tensors must stay alive (and unmodified) until the receiver has acked."""
    records = [_record(t) for t in tensors if t.numel()]
    out = torch.zeros(len(records) * RECORD_BYTES, dtype=torch.uint8)
    for index, record in enumerate(records):
        raw = json.dumps(record).encode()
        if len(raw) > RECORD_BYTES:
            raise ValueError(f"CUDA IPC record of {len(raw)} bytes exceeds {RECORD_BYTES}")
        out[index * RECORD_BYTES : index * RECORD_BYTES + len(raw)] = torch.frombuffer(
            bytearray(raw), dtype=torch.uint8
        )
    return out


def handles_buffer(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The empty host buffer a receiver posts for the records of a message shaped like `tensors`."""
    return torch.empty(sum(1 for t in tensors if t.numel()) * RECORD_BYTES, dtype=torch.uint8)


def copy_from_handles(records: torch.Tensor, out: Sequence[torch.Tensor]) -> None:
    """Copies the sender's tensors named by `records` into the contiguous CUDA tensors `out` (empty ones
    skipped) and waits until the copies are done."""
    targets = [t for t in out if t.numel()]
    # Every mapping stays open until all copies are done: tensors of one message usually share an
    # allocation, and PyTorch maps an allocation once while a reference to it is alive.
    sources = []
    for index, target in enumerate(targets):
        raw = bytes(records[index * RECORD_BYTES : (index + 1) * RECORD_BYTES].numpy()).rstrip(b"\0")
        sources.append(_open(json.loads(raw), target.device))
        if sources[-1].numel() != target.numel() * target.element_size():
            raise ValueError(
                f"CUDA IPC record {index} holds {sources[-1].numel()} bytes, expected "
                f"{target.numel() * target.element_size()}"
            )
        target.view(-1).view(torch.uint8).copy_(sources[-1], non_blocking=True)
    if targets:
        torch.cuda.current_stream(targets[0].device).synchronize()
    sources.clear()  # unmaps: the sender may reuse the memory after our ack


def _record(tensor: torch.Tensor) -> dict:
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("CUDA IPC moves contiguous CUDA tensors only")
    flat = tensor.view(-1).view(torch.uint8)
    (device, handle, size_bytes, offset_bytes, counter_handle, counter_offset, event_handle, event_sync) = (
        flat.untyped_storage()._share_cuda_()
    )
    return {
        "device": device,
        "handle": handle.hex(),
        "size": size_bytes,
        "offset": offset_bytes,
        "counter": counter_handle.hex(),
        "counter_offset": counter_offset,
        "event": event_handle.hex() if event_handle else "",
        "event_sync": bool(event_sync),
        "start": flat.storage_offset(),
        "bytes": flat.numel(),
    }


def _open(record: dict, device: torch.device) -> torch.Tensor:
    """Maps the sender's memory on `device` (the same GPU, whatever its index in this process)."""
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index,
        bytes.fromhex(record["handle"]),
        record["size"],
        record["offset"],
        bytes.fromhex(record["counter"]),
        record["counter_offset"],
        bytes.fromhex(record["event"]) if record["event"] else None,
        record["event_sync"],
    )
    view = torch.empty(0, dtype=torch.uint8, device=device)
    return view.set_(storage, record["start"], (record["bytes"],), (1,))  # contiguous bytes
