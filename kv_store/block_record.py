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

Shard records: a rank of a tensor-parallel decode instance holds only KV heads [start, end) of N, so it
writes those heads of each block as a record of the same format whose payload holds only its heads
(`BlockCodec(storage, heads=HeadRange(...))`), under a layout digest that also names the range
(``...; heads start:end``). Records of different ranges never share a key, and a range's bytes are the
same whichever TP size wrote them. A reader assembles whole blocks from the ranges of a layout
(`kv_store/block_shards.py`). A range covering every head is a whole record, key and all.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine.block_hash import BLOCK_HASH_BYTES, BlockHash
from engine.kv_storage import KVCacheStorage

RECORD_MAGIC = b"SKV1"
_HEADER = struct.Struct(f"<4s16s{BLOCK_HASH_BYTES}s16sI")
HEADER_BYTES = _HEADER.size


class HeadRange(NamedTuple):
    """KV heads [start, end) of `total`: what one tensor-parallel rank holds of each block."""

    start: int
    end: int
    total: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.total


def layout_digest(storage: KVCacheStorage, heads: HeadRange | None = None) -> bytes:
    """16 bytes naming the KV layout a record's payload is in (see the module docstring); `heads`: the
    range `storage` holds of a larger head count (a TP rank), None for all of them."""
    total = storage.num_kv_heads if heads is None else heads.total
    words = f"{storage.layout}; kv_heads {total}"
    if heads is not None and not heads.whole:
        words += f"; heads {heads.start}:{heads.end}"
    return hashlib.blake2b(words.encode(), digest_size=16).digest()


def block_key(layout: bytes, block_hash: BlockHash) -> bytes:
    return b"kvb:" + layout.hex().encode() + b":" + bytes(block_hash).hex().encode()


def hash_of_key(key: bytes) -> BlockHash:
    """The block hash a `block_key` names (its last field)."""
    return BlockHash(bytes.fromhex(key.rsplit(b":", 1)[1].decode()))


def check_record(record: bytes | None, layout: bytes, block_hash: BlockHash, record_bytes: int) -> bool:
    """Whether `record` is a whole (`record_bytes` long), uncorrupted record of `block_hash` in `layout`."""
    if record is None or len(record) != record_bytes:
        return False
    magic, stored_layout, stored_hash, checksum, length = _HEADER.unpack_from(record)
    if magic != RECORD_MAGIC or stored_layout != layout or stored_hash != bytes(block_hash):
        return False
    payload = memoryview(record)[HEADER_BYTES:]
    return length == len(payload) and hashlib.blake2b(payload, digest_size=16).digest() == checksum


class BlockCodec:
    """Encodes blocks of one `KVCacheStorage` to records and decodes records back into its blocks."""

    def __init__(self, storage: KVCacheStorage, heads: HeadRange | None = None):
        """`heads`: the range of a larger head count that `storage` holds (a TP rank: shard records)."""
        if heads is not None and heads.end - heads.start != storage.num_kv_heads:
            raise ValueError(f"heads {heads.start}:{heads.end} but the storage holds {storage.num_kv_heads} heads")
        self.storage = storage
        self.layout = layout_digest(storage, heads)
        one, two = storage.staging(1), storage.staging(2)
        self._part_shapes = [(t.shape, t.dtype, t.numel() * t.element_size()) for t in one]
        # the axis a transfer message stacks blocks on: where one block's staging differs from two's
        self._block_axes = [
            next(i for i, (a, b) in enumerate(zip(x.shape, y.shape, strict=True)) if a != b)
            for x, y in zip(one, two, strict=True)
        ]
        self.part_bytes = [size for _, _, size in self._part_shapes]  # one layer's parts: values, then scales
        self.payload_bytes = storage.num_layers * sum(self.part_bytes)
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
        return check_record(record, self.layout, block_hash, self.record_bytes)

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
