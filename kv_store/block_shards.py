"""Blocks stored as head shards by a tensor-parallel decode instance, and reading them back whole.

Each rank of a decode instance of `tp_size` ranks holds KV heads [start, end) of every block (the split
the KV hand-off uses: `head_ranges`). It writes its heads of each block it fills as a shard record
(`kv_store/block_record.py`, layout digest naming the range); no bytes cross between ranks. A reader
whose pool holds every head (a prefill worker resuming a migrated request) reads the shard records of
all the ranges of the decode layout, checks each one on its own (magic, layout, hash, length,
checksum) and joins their payloads head by head into one whole record of its own layout. A block with
any shard missing or refused is a miss, and the run of blocks ends there: it is computed instead.

Ranks holding the same heads (more ranks than KV heads) are replicas: only the first of them writes.
A layout where one range covers every head (tp_size 1, an MLA latent) writes whole records instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.block_hash import BlockHash
from kv_store.block_record import HEADER_BYTES, BlockCodec, HeadRange, block_key, check_record, layout_digest


def head_ranges(num_kv_heads: int, tp_size: int) -> list[HeadRange]:
    """The distinct head ranges the ranks of a `tp_size` decode instance hold, in rank order."""
    return list(dict.fromkeys(rank_heads(rank, num_kv_heads, tp_size) for rank in range(tp_size)))


def rank_heads(rank: int, num_kv_heads: int, tp_size: int) -> HeadRange:
    """Heads rank `rank` holds: an equal slice, or (ranks outnumbering heads) a replicated one."""
    per_rank = max(1, num_kv_heads // tp_size)
    replicas = max(1, tp_size // num_kv_heads)
    start = (rank // replicas) * per_rank
    return HeadRange(start, start + per_rank, num_kv_heads)


def writes_shards(rank: int, num_kv_heads: int, tp_size: int) -> bool:
    """Whether `rank` writes its range (the first replica of each range does)."""
    return rank % max(1, tp_size // num_kv_heads) == 0


class ShardAssembler:
    """Reads whole blocks of `codec`'s layout from the shard records of `ranges` (which cover every head
    of `codec`'s storage exactly once, in head order)."""

    def __init__(self, codec: BlockCodec, ranges: Sequence[HeadRange]):
        total = codec.storage.num_kv_heads
        bounds = [0] + [r.end for r in ranges]
        if [r.start for r in ranges] != bounds[:-1] or bounds[-1] != total or any(r.total != total for r in ranges):
            raise ValueError(f"head ranges {list(ranges)} do not split {total} heads in order")
        self.codec, self.ranges = codec, tuple(ranges)
        self.layouts = [layout_digest(codec.storage, heads) for heads in self.ranges]
        planes = codec.storage.planes
        # each part of a layer (values, scales) as [planes, heads, bytes of one head's block]
        self._head_bytes = [size // (planes * total) for size in codec.part_bytes]
        self._shard_bytes = [
            HEADER_BYTES + codec.storage.num_layers * planes * sum(self._head_bytes) * (r.end - r.start)
            for r in self.ranges
        ]

    @property
    def width(self) -> int:
        """Shard records per block."""
        return len(self.ranges)

    def keys(self, block_hash: BlockHash) -> list[bytes]:
        return [block_key(layout, block_hash) for layout in self.layouts]

    def check(self, index: int, record: bytes | None, block_hash: BlockHash) -> bool:
        """Whether `record` is a whole, uncorrupted shard record of range `index` of `block_hash`."""
        return check_record(record, self.layouts[index], block_hash, self._shard_bytes[index])

    def assemble(self, block_hash: BlockHash, shards: Sequence[bytes]) -> bytes:
        """The whole record of checked `shards` (one per range, in order): payloads joined head by head."""
        planes, offsets = self.codec.storage.planes, [HEADER_BYTES] * len(shards)
        parts: list[bytes] = []
        for _ in range(self.codec.storage.num_layers):
            for head_bytes in self._head_bytes:
                pieces = []
                for i, (shard, heads) in enumerate(zip(shards, self.ranges, strict=True)):
                    count = heads.end - heads.start
                    piece = np.frombuffer(shard, dtype=np.uint8, count=planes * count * head_bytes, offset=offsets[i])
                    pieces.append(piece.reshape(planes, count, head_bytes))
                    offsets[i] += piece.size
                parts.append(np.concatenate(pieces, axis=1).tobytes())
        return self.codec.seal(block_hash, parts)
