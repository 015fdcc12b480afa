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
    # Where the blocks are: the pool (whose events this module emits), or the worker's host tier (its
    # writer publishes those, with no parent or tokens). Consumers that know only the pool read the default.
    medium: str = "pool"


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks with these hashes are no longer cached on this worker (evicted or reset) in `medium`."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = "pool"


# The media a KV event names (vLLM's KV events call the field `medium` too).
MEDIUM_POOL = "pool"
MEDIUM_HOST = "host"
MEDIA = (MEDIUM_POOL, MEDIUM_HOST)


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
        # The free queue is the blocks never handed out, [_fresh, num_blocks) in id order, followed by
        # `_free`, released blocks in LRU order (insertion order; OrderedDict gives O(1) removal from
        # the middle on a hit). Fresh blocks are not listed: a pool of millions of blocks (a fleet's in
        # the simulator, a large GPU's) starts without building a queue of them.
        self._fresh = 0
        self._free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}
        self._entries: dict[int, _CacheEntry] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now, cached ones (evictable) included."""
        return self.num_blocks - self._fresh + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a registered hash, whether in use or free."""
        return len(self._entries)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        self._check_id(block_id)
        return block_id >= self._fresh or block_id in self._free

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free queue, evicting any cached ones among them."""
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free_blocks} free")
        fresh = min(count, self.num_blocks - self._fresh)
        taken = list(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        taken += [self._free.popitem(last=False)[0] for _ in range(count - fresh)]
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
        refs = self._ref_counts
        # Checked in bulk when each id comes once (the usual case: one sequence's table); a repeated id
        # is counted, so releasing a block twice needs two references.
        if (
            not self._valid_ids(block_ids)
            or len(set(block_ids)) != len(block_ids)
            or 0 in map(refs.__getitem__, block_ids)
        ):
            for block_id, times in Counter(block_ids).items():
                self._check_id(block_id)
                if refs[block_id] < times:
                    raise ValueError(f"block {block_id} released {times}x with ref count {refs[block_id]}")
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
        tokens = tuple(token_ids)
        if self._cache(block_id, block_hash, tokens):
            self._emit(BlockStored((block_hash,), parent_hash, tokens))

    def mark_cached_chain(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[Sequence[int]] | None = None,
        *,
        parent_hash: BlockHash | None = None,
    ) -> None:
        """`mark_cached` for consecutive blocks of one sequence (each block's parent is the one before
        it; the first's is `parent_hash`), emitting one BlockStored per run of blocks it newly caches
        rather than one per block. `token_ids`: each block's tokens (None: none recorded)."""
        run: list[BlockHash] = []
        run_tokens: list[int] = []
        run_parent = previous = parent_hash
        try:
            for i, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes, strict=True)):
                tokens = () if token_ids is None else tuple(token_ids[i])
                if self._cache(block_id, block_hash, tokens):
                    if not run:
                        run_parent = previous
                    run.append(block_hash)
                    run_tokens.extend(tokens)
                elif run:
                    self._emit(BlockStored(tuple(run), run_parent, tuple(run_tokens)))
                    run, run_tokens = [], []
                previous = block_hash
        finally:  # what was cached before a bad block is announced all the same
            if run:
                self._emit(BlockStored(tuple(run), run_parent, tuple(run_tokens)))

    def _cache(self, block_id: int, block_hash: BlockHash, tokens: tuple[int, ...]) -> bool:
        """Registers the block under the hash; False when it was already (or the hash maps elsewhere)."""
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only blocks in use can be marked cached")
        entry = self._entries.get(block_id)
        if entry is not None:
            if entry.block_hash != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return False
        if block_hash in self._hash_to_block:
            return False
        self._entries[block_id] = _CacheEntry(block_hash, tokens)
        self._hash_to_block[block_hash] = block_id
        return True

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
                (ref == 0) == (block_id >= self._fresh or block_id in self._free),
                f"block {block_id} (ref {ref}) must be in the free queue iff its ref count is 0",
            )
        _require(all(0 <= b < self._fresh for b in self._free), "free queue holds an unknown or fresh block id")
        _require(self.num_free_blocks == self._ref_counts.count(0), "free count disagrees with ref counts")
        _require(len(self._hash_to_block) == len(self._entries), "hash map and cache entries differ in size")
        for block_id, entry in self._entries.items():
            _require(
                self._hash_to_block.get(entry.block_hash) == block_id,
                f"block {block_id}'s hash does not map back to it",
            )

    def _valid_ids(self, block_ids: list[int]) -> bool:
        return not block_ids or (
            all(isinstance(b, int) for b in block_ids) and min(block_ids) >= 0 and max(block_ids) < self.num_blocks
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
