"""Per-sequence block tables over one BlockPool: the scheduler asks, then acts.

The scheduler never touches the pool. For each sequence it asks `find_cached_prefix` (which leading
blocks are already computed somewhere in the pool), `can_allocate` (is there room), and only then
`allocate`; after the model ran it calls `cache_blocks` so newly full blocks become prefix hits; when
the sequence ends it calls `free`. The decode role uses the same API: reserving blocks for a sequence
whose KV will be imported is `allocate(seq_id, num_tokens)` with no cached prefix.

A CachedPrefix is valid only until the pool changes (another sequence's `allocate` may evict its
blocks), so ask and act for one sequence before moving to the next. `allocate` rejects a prefix whose
blocks are no longer cached.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

from engine.block_hash import BlockHash
from engine.block_pool import BlockPool, IntegrityError, KVCacheEvent, NoFreeBlocksError


class CachedPrefix(NamedTuple):
    """Leading blocks of a sequence found in the prefix cache, verified token by token."""

    block_ids: tuple[int, ...]
    num_tokens: int  # = len(block_ids) * block_size


EMPTY_PREFIX = CachedPrefix((), 0)


class KVCacheManager:
    """Maps sequence ids (str) to block tables and keeps the pool's ref counts equal to table holdings."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_event: Callable[[KVCacheEvent], None] | None = None,
    ):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks, on_event)
        self._tables: dict[str, list[int]] = {}
        # How many leading blocks of each table are already registered, so cache_blocks is O(new blocks).
        self._num_registered: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some sequence; free cached blocks count as unused."""
        return 1.0 - self._pool.num_free_blocks / self._pool.num_blocks

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: str) -> tuple[int, ...]:
        return tuple(self._tables[seq_id])

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block registered under `block_hash` (in use or free), or None; valid until the pool changes."""
        return self._pool.lookup(block_hash)

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> CachedPrefix:
        """Longest run of leading full blocks that are cached and hold exactly these tokens.

        At least one token is always left to compute so the model produces logits for the next token:
        a prompt of exactly N full blocks hits at most N - 1 of them.
        """
        if not self.enable_prefix_caching:
            return EMPTY_PREFIX
        size = self.block_size
        max_blocks = min(max(len(token_ids) - 1, 0) // size, len(block_hashes))
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self._pool.lookup(block_hashes[i])
            # Token equality guards against a hash collision (or a caller's wrong hash) reusing wrong KV.
            if block_id is None or self._pool.cached_tokens(block_id) != tuple(token_ids[i * size : (i + 1) * size]):
                break
            hits.append(block_id)
        return CachedPrefix(tuple(hits), len(hits) * size)

    def can_allocate(self, seq_id: str, num_tokens: int, cached: CachedPrefix = EMPTY_PREFIX) -> bool:
        """Whether the sequence's table can grow to cover `num_tokens` tokens.

        Cached blocks sitting in the free queue count against free capacity: acquiring them takes them
        out of the queue just like a fresh allocation.
        """
        return self._blocks_to_take(seq_id, num_tokens, cached) <= self._pool.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int, cached: CachedPrefix = EMPTY_PREFIX) -> tuple[int, ...]:
        """Grow the table to cover `num_tokens`; on a sequence's first call, start it with `cached`.

        Returns the full block table. Raises NoFreeBlocksError when `can_allocate` would say False.
        """
        needed = self._blocks_to_take(seq_id, num_tokens, cached)
        if needed > self._pool.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq_id!r} needs {needed} blocks, {self._pool.num_free_blocks} free")
        table = self._tables.get(seq_id)
        if table is None:
            self._check_prefix_current(cached)
            # Acquire the hits before allocating so the allocation cannot evict them.
            self._pool.acquire(cached.block_ids)
            table = self._tables[seq_id] = list(cached.block_ids)
            self._num_registered[seq_id] = len(cached.block_ids)
        missing = self._num_blocks_for(num_tokens) - len(table)
        if missing > 0:
            table.extend(self._pool.allocate(missing))
        return tuple(table)

    def cache_blocks(
        self, seq_id: str, token_ids: Sequence[int], block_hashes: Sequence[BlockHash], num_computed_tokens: int
    ) -> None:
        """Register every block of the sequence that is full and computed and not registered yet."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq_id]
        if num_computed_tokens > len(token_ids):
            raise ValueError(f"{num_computed_tokens} computed tokens but only {len(token_ids)} tokens")
        num_ready = num_computed_tokens // self.block_size
        if num_ready > len(block_hashes) or num_ready > len(table):
            raise ValueError(
                f"{num_ready} computed full blocks but {len(block_hashes)} hashes and {len(table)} blocks in the table"
            )
        size = self.block_size
        for i in range(self._num_registered[seq_id], num_ready):
            parent = block_hashes[i - 1] if i > 0 else None
            self._pool.mark_cached(table[i], block_hashes[i], token_ids[i * size : (i + 1) * size], parent_hash=parent)
        self._num_registered[seq_id] = max(self._num_registered[seq_id], num_ready)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Shrink the table to the blocks covering `num_tokens` tokens (speculative decoding's rollback
        of rejected drafts' slots); the blocks past them go back to the pool, tail first. Registered
        (hashed) blocks hold computed tokens and are never cut."""
        table = self._tables[seq_id]
        keep = self._num_blocks_for(num_tokens)
        if keep < self._num_registered[seq_id]:
            raise ValueError(f"sequence {seq_id!r}: truncating to {num_tokens} tokens would cut registered blocks")
        if keep < len(table):
            self._pool.release(reversed(table[keep:]))
            del table[keep:]

    def free(self, seq_id: str) -> None:
        """Release the sequence's blocks tail first, so its last blocks are evicted first."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        del self._num_registered[seq_id]
        self._pool.release(reversed(table))

    def reset_prefix_cache(self) -> None:
        self._pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool integrity, and every block's ref count equals the number of tables holding it."""
        self._pool.check_integrity()
        _require(self._num_registered.keys() == self._tables.keys(), "registered counts and tables disagree")
        holders: Counter[int] = Counter()
        for seq_id, table in self._tables.items():
            _require(len(set(table)) == len(table), f"sequence {seq_id!r} holds a block twice")
            _require(
                0 <= self._num_registered[seq_id] <= len(table),
                f"sequence {seq_id!r} has an impossible registered-block count",
            )
            holders.update(table)
        for block_id in range(self._pool.num_blocks):
            _require(
                self._pool.ref_count(block_id) == holders[block_id],
                f"block {block_id} has ref count {self._pool.ref_count(block_id)} "
                f"but {holders[block_id]} tables hold it",
            )

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _blocks_to_take(self, seq_id: str, num_tokens: int, cached: CachedPrefix) -> int:
        """Free-queue blocks the call would consume: new blocks plus revived free cached ones."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        table = self._tables.get(seq_id)
        if table is not None:
            if cached.block_ids:
                raise ValueError(f"sequence {seq_id!r} already has blocks; a cached prefix applies only first")
            return max(self._num_blocks_for(num_tokens) - len(table), 0)
        if (
            cached.num_tokens != len(cached.block_ids) * self.block_size
            or num_tokens < cached.num_tokens
            or len(set(cached.block_ids)) != len(cached.block_ids)
        ):
            raise ValueError(f"cached prefix {cached} does not fit {num_tokens} tokens of block size {self.block_size}")
        revived = sum(1 for block_id in cached.block_ids if self._pool.is_free(block_id))
        return self._num_blocks_for(num_tokens) - len(cached.block_ids) + revived

    def _check_prefix_current(self, cached: CachedPrefix) -> None:
        for block_id in cached.block_ids:
            if self._pool.cached_tokens(block_id) is None:
                raise ValueError(f"cached prefix is stale: block {block_id} was evicted since it was found")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)
