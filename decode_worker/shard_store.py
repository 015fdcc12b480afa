"""Every rank of a tensor-parallel decode instance stores its KV heads of the blocks its sequences fill,
so a request migrated off the instance resumes from the shared store (kv_store/block_shards.py says how
a reader joins the shards; docs/architecture.md, "KV tiers", why shards and not a gather to rank 0).

Which blocks: those whose last slot a step wrote and that rank 0's pool registered (BlockStored) right
after that step. Every rank applies the same rule to the same step, so the shards of one block hold the
KV of one forward. A block whose KV came in a hand-off (a prompt block) is not one: the prefill worker
that computed it stored it whole.

- Rank 0 (`LeaderShards`, engine thread): copies its heads of such blocks out of the pool and queues
  them for its writer, and queues (step number, block id, block hash) for the other ranks; a thread
  sends those with one Ray call per batch (`FilledBlocks`), so the step never waits on a rank or the store.
- Ranks > 0 (`FollowerShards`) have no block pool and no hashes. Around each forward they note the
  blocks whose last slot the step writes and copy them out right after it, keyed by (block id, step
  number); rank 0's `FilledBlocks` names the hash of each, and the matching copies go to the writer.
  A copy rank 0 never names (a speculative token rejected at a block's last slot) ages out.
- A filled block may be freed and reserved for a hand-off before this rank has copied it. The hand-off
  cannot write into it before every rank's `expect` returned, and `expect` first gives up any of its
  blocks still waiting to be copied (`before_import`): such a block is a miss later, never a copy of
  the wrong KV. Copies and names are paired under one lock, in whichever order they come.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from common.actor_api import DecodeRankHandle
from common.messages import FilledBlocks
from decode_worker.tp_group import TensorParallelEngine
from engine.block_hash import BlockHash
from engine.block_pool import BlockStored, KVCacheEvent
from engine.model_runner import StepInput
from kv_store.worker_tiers import WorkerKVTiers

log = logging.getLogger(__name__)
MAX_COPY_AGE_MESSAGES = 512  # a copy rank 0 has not named after this many group messages is dropped
MAX_QUEUED_NOTICES = 1024  # rank 0's batches waiting for the sender; beyond it new ones are dropped


def filled_blocks(step: StepInput, block_size: int) -> frozenset[int]:
    """The blocks whose last slot `step` writes."""
    slots = step.slot_mapping.cpu()
    return frozenset((slots[slots % block_size == block_size - 1] // block_size).tolist())


class LeaderShards:
    """Rank 0: its own shards, and the notices that tell the other ranks which blocks to store."""

    def __init__(
        self, tiers: WorkerKVTiers, engine: TensorParallelEngine, followers: Sequence[DecodeRankHandle], block_size: int
    ):
        self.tiers, self.engine, self.block_size = tiers, engine, block_size
        self.followers = tuple(followers)
        self.notices_dropped = 0
        self._filled: tuple[int, frozenset[int]] = (-1, frozenset())
        self._queue: queue.Queue[list[tuple[int, int, BlockHash]] | None] = queue.Queue(MAX_QUEUED_NOTICES)
        self._thread = threading.Thread(target=self._send, name="kv-shard-notices", daemon=True)
        if self.followers:
            self._thread.start()

    def on_kv_event(self, event: KVCacheEvent) -> None:
        """Engine thread, right after a step: store this rank's heads of the blocks the step filled."""
        last = self.engine.last_step
        if not isinstance(event, BlockStored) or last is None or self.tiers.kv is None:
            return
        sequence, step = last
        if self._filled[0] != sequence:
            self._filled = (sequence, filled_blocks(step, self.block_size))
        filled = self._filled[1]
        self.tiers.on_kv_event(event, filled.__contains__)
        if not self.followers:
            return
        notices = []
        for block_hash in event.block_hashes:
            block_id = self.tiers.kv.cached_block(block_hash)
            if block_id is not None and block_id in filled:
                notices.append((sequence, block_id, block_hash))
        if notices:
            try:
                self._queue.put_nowait(notices)
            except queue.Full:  # the ranks' shards of these blocks go unwritten: a later migration recomputes
                self.notices_dropped += 1

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                return  # a daemon thread: it goes with the process
            self._thread.join(timeout_s)

    def _send(self) -> None:
        closing = False
        while not closing:
            first = self._queue.get()
            if first is None:
                return
            batch = list(first)
            while not self._queue.empty():  # everything queued meanwhile goes in the same call
                more = self._queue.get_nowait()
                if more is None:
                    closing = True  # after this batch
                    break
                batch += more
            sequences, ids, hashes = zip(*batch, strict=True)
            message = FilledBlocks(tuple(sequences), tuple(ids), tuple(bytes(h) for h in hashes))
            for follower in self.followers:
                try:
                    follower.store_filled_blocks(message)  # not awaited: a dead rank just stores nothing
                except Exception:  # a dead rank is the supervisor's to see; the step must not hear of it
                    log.debug("could not tell a rank which blocks filled", exc_info=True)


class FollowerShards:
    """A rank > 0: copies of the blocks its steps filled, and rank 0's names for them, paired up in
    whichever order they come (a StepObserver)."""

    def __init__(self, tiers: WorkerKVTiers, block_size: int):
        self.tiers, self.block_size = tiers, block_size
        self.copies_dropped = 0  # copied but never named by rank 0, or named but never copied
        self.copies_given_up = 0  # a hand-off was about to overwrite them before they were copied
        self._lock = threading.Lock()
        self._pending: tuple[int, frozenset[int]] = (-1, frozenset())  # the step running now, its filled blocks
        self._copies: dict[tuple[int, int], list[bytes]] = {}  # (block id, step number) -> payload parts
        self._names: dict[tuple[int, int], BlockHash] = {}  # named by rank 0 before this rank copied them

    # ---- the follower thread --------------------------------------------------------------------
    def before_forward(self, sequence: int, step: StepInput) -> None:
        filled = filled_blocks(step, self.block_size)
        with self._lock:
            self._pending = (sequence, filled)

    def after_forward(self, sequence: int) -> None:
        with self._lock:
            step, pending = self._pending
            for block_id in pending:
                self._copies[(block_id, step)] = self.tiers.codec.snapshot(block_id)
            self._pending = (step, frozenset())
            named = self._pair()
            for entries in (self._copies, self._names):
                old = [key for key in entries if key[1] < sequence - MAX_COPY_AGE_MESSAGES]
                for key in old:
                    del entries[key]
                self.copies_dropped += len(old)
        self.tiers.store_snapshots(named)

    # ---- the actor's thread ---------------------------------------------------------------------
    def before_import(self, block_ids: Sequence[int]) -> None:
        """A hand-off is about to write into `block_ids`: a filled block among them that is not copied
        yet is given up (a miss for a later migration, never a copy of the wrong KV)."""
        with self._lock:
            step, pending = self._pending
            lost = pending & frozenset(block_ids)
            self._pending = (step, pending - lost)
            self.copies_given_up += len(lost)

    def on_filled(self, blocks: FilledBlocks) -> None:
        """Rank 0 named the hashes of filled blocks: queue this rank's copies of them for writing."""
        with self._lock:
            for sequence, block_id, block_hash in zip(
                blocks.step_sequences, blocks.block_ids, blocks.block_hashes, strict=True
            ):
                self._names[(block_id, sequence)] = BlockHash(block_hash)
            named = self._pair()
        self.tiers.store_snapshots(named)

    def _pair(self) -> list[tuple[BlockHash, list[bytes]]]:
        both = [key for key in self._names if key in self._copies]
        return [(self._names.pop(key), self._copies.pop(key)) for key in both]
