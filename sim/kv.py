"""KV memory of simulated workers: the engine's real `BlockPool` where the prefix cache matters.

`PrefixPool` (prefill and colocated workers) keeps a worker's prefix cache in a real
`engine.block_pool.BlockPool`: hits revive cached blocks, allocation evicts in LRU order, blocks
released after a hand-off stay cached until evicted, and every stored / removed block is a real KV
event (the router's real prefix index follows them, sim/router.py). A simulated block holds `block_tokens`
tokens, which may be coarser than the engine's 16 (a Mooncake trace only knows 512-token blocks;
16-token blocks would cost 32x the bookkeeping for no more information). Keys are the block hashes
of the request's `block_keys` (`sim.seq.block_hashes`: equal key = equal prefix).
As the engine's `KVCacheManager`: a prompt never hits its last token (at least one is computed), and
`can_take` counts revived free cached blocks against free capacity. `pull` is a prefix pull between
two pools (prefill_worker/prefix_pull.py): the requester reserves the blocks it lacks, the holder
pins the leading blocks it still has, and the requester registers them as cached (BlockStored events)
and keeps the whole prefix pinned until its request is admitted.

`BlockCounter` (decode instances, which keep no prefix cache) only counts blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.block_hash import BlockHash
from engine.block_pool import BlockPool, KVCacheEvent


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


class PrefixPool:
    def __init__(
        self,
        num_blocks: int,
        block_tokens: int,
        caching: bool = True,
        on_event: Callable[[KVCacheEvent], None] | None = None,
    ):
        self.block_tokens, self.caching = block_tokens, caching
        self.pool = BlockPool(num_blocks, on_event)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def match(self, keys: Sequence[BlockHash], prompt_tokens: int) -> list[int]:
        """Block ids of the longest cached run of leading blocks (never the whole prompt)."""
        if not self.caching:
            return []
        hits = []
        for key in keys[: max(prompt_tokens - 1, 0) // self.block_tokens]:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_take(self, hits: Sequence[int], total_blocks: int) -> bool:
        revived = sum(1 for b in hits if self.pool.is_free(b))
        return total_blocks - len(hits) + revived <= self.pool.num_free_blocks

    def take(self, hits: Sequence[int], total_blocks: int) -> list[int]:
        """A table of `total_blocks`: the hits (acquired first, so the allocation cannot evict them), then new ones."""
        self.pool.acquire(hits)
        return list(hits) + self.pool.allocate(total_blocks - len(hits))

    def mark(self, table: Sequence[int], keys: Sequence[BlockHash], first: int, upto: int) -> None:
        """Registers blocks [first, upto) of a table under their keys (they are full and computed)."""
        if not self.caching:
            return
        upto = min(upto, len(keys))
        if first < upto:
            parent = keys[first - 1] if first else None
            self.pool.mark_cached_chain(table[first:upto], keys[first:upto], parent_hash=parent)

    def release(self, table: Sequence[int]) -> None:
        """Tail first, as the engine frees a sequence: its last blocks are evicted first."""
        self.pool.release(reversed(table))

    def pull(self, holder: PrefixPool, keys: Sequence[BlockHash], prompt_tokens: int) -> tuple[list[int], int]:
        """Copies the leading blocks of `keys` that `holder` holds beyond the local ones into this pool.
        Returns the table pinning the prefix here (release it once the request holds it) and the number
        of blocks copied; ([], 0) when the holder has no more, or this pool has no room for them."""
        local = self.match(keys, prompt_tokens)
        held = holder.match(keys, prompt_tokens)
        if len(held) <= len(local) or not self.can_take(local, len(held)):
            return [], 0
        # The holder pins what it sends and lets it go after: those blocks become its most recently used.
        holder.pool.acquire(held)
        holder.release(held)
        table = self.take(local, len(held))
        self.mark(table, keys, len(local), len(held))
        return table, len(held) - len(local)

    def check_integrity(self) -> None:
        self.pool.check_integrity()


class BlockCounter:
    """Blocks of a decode instance: reserved for a sequence's whole context, freed when it ends."""

    def __init__(self, num_blocks: int):
        self.num_blocks, self.used = num_blocks, 0

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.used

    def can_take(self, blocks: int) -> bool:
        return blocks <= self.num_blocks - self.used

    def take(self, blocks: int) -> None:
        if blocks > self.num_blocks - self.used:
            raise RuntimeError(f"asked for {blocks} blocks, {self.num_blocks - self.used} free")
        self.used += blocks

    def release(self, blocks: int) -> None:
        if blocks > self.used:
            raise RuntimeError(f"released {blocks} blocks, {self.used} in use")
        self.used -= blocks
