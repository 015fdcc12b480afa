"""Physical KV blocks with reference counts, a prefix cache keyed by block hash, and LRU eviction.

The pool is the only owner of block ids; everything above it (the KV cache manager) asks it for
blocks and gives them back. Blocks are never copied or cleared here: a block released to the free
queue keeps its contents and its hash, so a later prefix hit can revive it for free, until
`allocate` hands it out again (eviction).

Single-threaded by contract: one scheduler loop owns a pool; nothing here locks.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash


class NoFreeBlocksError(RuntimeError):
    """More blocks were requested than the free queue holds; callers should have asked first."""


class IntegrityError(AssertionError):
    """Internal bookkeeping is inconsistent: a bug, never a condition to handle at run time."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks became reusable by prefix hits on this worker.

    `parent_hash` is the hash of the block before the first one, or None when the first block is a
    sequence's first (its parent is the namespace root). `token_ids` are the blocks' tokens in order.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks with these hashes are no longer cached on this worker (evicted or reset)."""

    block_hashes: tuple[BlockHash, ...]


# Events carry hashes and token ids only; the publisher adds worker identity and sequence numbers.
KVCacheEvent = BlockStored | BlockRemoved


@dataclass(frozen=True)
class _CacheEntry:
    block_hash: BlockHash
    token_ids: tuple[int, ...]


class BlockPool:
    """Owns block ids 0..num_blocks-1.

    Each block is either in use (ref_count > 0) or in the free queue (ref_count == 0). A free block may
    still be *cached* (hash registered) and can be revived by a prefix hit until it is evicted.
    Eviction is LRU: `allocate` takes from the head of the free queue, `release` appends to the tail.
    """

    def __init__(self, num_blocks: int, on_event: Callable[[KVCacheEvent], None] | None = None):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._on_event = on_event
        self._ref_counts = [0] * num_blocks
        # Insertion order is the LRU order; OrderedDict gives O(1) removal from the middle on a hit.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[BlockHash, int] = {}
        self._entries: dict[int, _CacheEntry] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now, cached ones (evictable) included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a registered hash, whether in use or free."""
        return len(self._entries)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        self._check_id(block_id)
        return block_id in self._free

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free queue, evicting any cached ones among them."""
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        taken = [self._free.popitem(last=False)[0] for _ in range(count)]
        evicted: list[BlockHash] = []
        for block_id in taken:
            self._ref_counts[block_id] = 1
            entry = self._entries.pop(block_id, None)
            if entry is not None:
                del self._hash_to_block[entry.block_hash]
                evicted.append(entry.block_hash)
        if evicted:
            self._emit(BlockRemoved(tuple(evicted)))
        return taken

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The cached block holding `block_hash`, in use or free; None when not cached."""
        return self._hash_to_block.get(block_hash)

    def cached_tokens(self, block_id: int) -> tuple[int, ...] | None:
        """Tokens recorded by `mark_cached`, to verify a hit against; None when not cached."""
        self._check_id(block_id)
        entry = self._entries.get(block_id)
        return None if entry is None else entry.token_ids

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block; a free one leaves the free queue (a prefix hit revives it).

        A free block must be cached: an uncached free block holds garbage nobody can ask for.
        All ids are checked before any is taken, so a bad call changes nothing.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0 and block_id not in self._entries:
                raise ValueError(f"block {block_id} is free and not cached; it cannot be acquired")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop a reference from each block; one reaching 0 goes to the free queue tail, in order.

        Callers pass a sequence's blocks in reverse so that its tail blocks (least likely to be shared
        by another prompt) are evicted first. All ids are checked before any is released.
        """
        block_ids = list(block_ids)
        for block_id, times in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref_counts[block_id] < times:
                raise ValueError(f"block {block_id} released {times}x with ref count {self._ref_counts[block_id]}")
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def mark_cached(
        self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int], *, parent_hash: BlockHash | None = None
    ) -> None:
        """Register a full, computed, in-use block under `block_hash` and emit BlockStored.

        If the hash already maps to another block (two sequences computed the same prefix at once), the
        existing mapping wins and this block stays uncached: one hash, one block, and it is freed like
        any uncached block. Marking a block again with its own hash is a no-op.
        """
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only blocks in use can be marked cached")
        entry = self._entries.get(block_id)
        if entry is not None:
            if entry.block_hash != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return
        if block_hash in self._hash_to_block:
            return
        tokens = tuple(token_ids)
        self._entries[block_id] = _CacheEntry(block_hash, tokens)
        self._hash_to_block[block_hash] = block_id
        self._emit(BlockStored((block_hash,), parent_hash, tokens))

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of all free blocks (e.g. after weights change); in-use blocks keep theirs."""
        dropped = [block_id for block_id in self._free if block_id in self._entries]
        hashes = tuple(self._entries.pop(block_id).block_hash for block_id in dropped)
        for block_hash in hashes:
            del self._hash_to_block[block_hash]
        if hashes:
            self._emit(BlockRemoved(hashes))

    def check_integrity(self) -> None:
        """Raise IntegrityError naming the first broken invariant; tests call it after every scenario."""
        _require(len(self._ref_counts) == self.num_blocks, "ref count table has the wrong size")
        for block_id, ref in enumerate(self._ref_counts):
            _require(ref >= 0, f"block {block_id} has negative ref count {ref}")
            _require(
                (ref == 0) == (block_id in self._free),
                f"block {block_id} (ref {ref}) must be in the free queue iff its ref count is 0",
            )
        _require(all(0 <= b < self.num_blocks for b in self._free), "free queue holds an unknown block id")
        _require(len(self._free) == self._ref_counts.count(0), "free count disagrees with ref counts")
        _require(len(self._hash_to_block) == len(self._entries), "hash map and cache entries differ in size")
        for block_id, entry in self._entries.items():
            _require(
                self._hash_to_block.get(entry.block_hash) == block_id,
                f"block {block_id}'s hash does not map back to it",
            )

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id must be in [0, {self.num_blocks}), got {block_id!r}")

    def _emit(self, event: KVCacheEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)
