"""One block's KV as bytes: the record every tier stores, and the key it is stored under.

Record (version 1), all integers little-endian::

    b"SKV1" | layout digest (16 B) | block hash (16 B) | checksum (16 B) | payload length (u32) | payload

The payload is the block's KV on every layer, in layer order, each layer as the pool's transfer
methods export it (`KVCacheStorage.export_layer`: values, then scales for quantized formats), byte for
byte: a record moves KV as stored, with no dequantize or requantize, exactly like a hand-off.
The checksum is BLAKE2b-128 of the payload. Decoding checks the magic, the layout, the block hash, the
length and the checksum, and refuses the record on any mismatch: a corrupt or foreign block is a
miss, and the block is computed instead.

Key: ``kvb:<layout digest hex>:<block hash hex>``. The block hash already names the model, the block
size and the tenant (its chain's root is seeded with them), so tenants never share a key; the layout
digest adds what the hash does not cover (KV dtype, layers, KV heads, head size), so two deployments
of one model with different KV dtypes never read each other's blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np
import torch

from engine.block_hash import BLOCK_HASH_BYTES, BlockHash
from engine.kv_storage import KVCacheStorage

RECORD_MAGIC = b"SKV1"
_HEADER = struct.Struct(f"<4s16s{BLOCK_HASH_BYTES}s16sI")
HEADER_BYTES = _HEADER.size


def layout_digest(storage: KVCacheStorage) -> bytes:
    """16 bytes naming the KV layout a record's payload is in (see the module docstring)."""
    words = f"{storage.layout}; kv_heads {storage.num_kv_heads}".encode()
    return hashlib.blake2b(words, digest_size=16).digest()


def block_key(layout: bytes, block_hash: BlockHash) -> bytes:
    return b"kvb:" + layout.hex().encode() + b":" + bytes(block_hash).hex().encode()


class BlockCodec:
    """Encodes blocks of one `KVCacheStorage` to records and decodes records back into its blocks."""

    def __init__(self, storage: KVCacheStorage):
        self.storage = storage
        self.layout = layout_digest(storage)
        one, two = storage.staging(1), storage.staging(2)
        self._part_shapes = [(t.shape, t.dtype, t.numel() * t.element_size()) for t in one]
        # the axis a transfer message stacks blocks on: where one block's staging differs from two's
        self._block_axes = [
            next(i for i, (a, b) in enumerate(zip(x.shape, y.shape, strict=True)) if a != b)
            for x, y in zip(one, two, strict=True)
        ]
        self.payload_bytes = storage.num_layers * sum(size for _, _, size in self._part_shapes)
        self.record_bytes = HEADER_BYTES + self.payload_bytes

    def key(self, block_hash: BlockHash) -> bytes:
        return block_key(self.layout, block_hash)

    def encode(self, block_id: int, block_hash: BlockHash) -> bytes:
        """Block `block_id`'s KV, all layers, as a record (a copy: the block may be reused after)."""
        return self.seal(block_hash, self.snapshot(block_id))

    def snapshot(self, block_id: int) -> list[bytes]:
        """The block's payload parts, copied out of the pool: the only part of encoding that must run
        before the block can be reused (on the engine thread); `seal` does the rest on any thread."""
        ids = torch.tensor([block_id], dtype=torch.int64)
        heads = self.storage.num_kv_heads
        return [
            tensor.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes()
            for layer in range(self.storage.num_layers)
            for tensor in self.storage.export_layer(layer, 0, heads, ids)
        ]

    def seal(self, block_hash: BlockHash, parts: Sequence[bytes]) -> bytes:
        """The record of a `snapshot`: its parts joined behind the header and checksum (the checksum is
        most of encoding's time, which is why the writer thread does it)."""
        payload = b"".join(parts)
        checksum = hashlib.blake2b(payload, digest_size=16).digest()
        return _HEADER.pack(RECORD_MAGIC, self.layout, bytes(block_hash), checksum, len(payload)) + payload

    def check(self, record: bytes | None, block_hash: BlockHash) -> bool:
        """Whether `record` is a whole, uncorrupted record of `block_hash` in this layout."""
        if record is None or len(record) != self.record_bytes:
            return False
        magic, layout, stored_hash, checksum, length = _HEADER.unpack_from(record)
        if magic != RECORD_MAGIC or layout != self.layout or stored_hash != bytes(block_hash):
            return False
        payload = memoryview(record)[HEADER_BYTES:]
        return length == len(payload) and hashlib.blake2b(payload, digest_size=16).digest() == checksum

    def decode_into(self, block_ids: Sequence[int], records: Sequence[bytes]) -> None:
        """Writes checked records (see `check`) into the pool's blocks `block_ids`, one record each."""
        if len(block_ids) != len(records):
            raise ValueError(f"{len(records)} records for {len(block_ids)} blocks")
        if not records:
            return
        device = self.storage.values.device
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        offset = HEADER_BYTES
        for layer in range(self.storage.num_layers):
            tensors = []
            for (shape, dtype, size), axis in zip(self._part_shapes, self._block_axes, strict=True):
                rows = np.stack(
                    [np.frombuffer(record, dtype=np.uint8, count=size, offset=offset) for record in records]
                )
                joined = torch.from_numpy(rows).view(dtype).reshape(len(records), *shape)
                tensors.append(torch.cat(list(joined), dim=axis).to(device))
                offset += size
            self.storage.import_layer(layer, ids, tensors)
