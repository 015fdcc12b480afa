"""The tiers of one worker read as one: host tier first, then the shared store; and their writer.

`TieredStore.fetch_chain` answers the leading run of a prompt's blocks found in any tier (a prefix is
only useful up to its first gap), reading in windows so a long prompt whose chain breaks early costs
one window, and copies what a lower tier answered into the tiers above it (the next hit is local).
`StoreWriter` takes records from the engine thread without waiting and writes them on its own thread;
when writes come faster than the tiers take them it drops the oldest-queued batch and counts it: a
write is an optimization, and the engine never waits on one. A queued value may be a function making
the record, so the engine thread only copies a block out and the writer thread seals it
(`BlockCodec.snapshot` / `seal`: the checksum is most of encoding's time).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kv_store.base import BlockStore

log = logging.getLogger(__name__)
CHAIN_WINDOW = 32  # keys read per round trip of a chain lookup
RecordSource = bytes | Callable[[], bytes]  # a record, or what makes it on the writer thread


class TieredStore:
    def __init__(self, tiers: Sequence[BlockStore]):
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = tuple(tiers)

    def fetch_chain(self, keys: Sequence[bytes], accept: Callable[[int, bytes], bool] | None = None) -> list[bytes]:
        """Records of keys[0..k) for the largest k all tiers together hold; `accept(i, record)` (a
        checksum check) may refuse one, which ends the run there like a miss."""
        run: list[bytes] = []
        for start in range(0, len(keys), CHAIN_WINDOW):
            window = list(keys[start : start + CHAIN_WINDOW])
            found = self._read(window)
            for offset, record in enumerate(found):
                if record is None or (accept is not None and not accept(start + offset, record)):
                    return run
                run.append(record)
        return run

    def _read(self, keys: list[bytes]) -> list[bytes | None]:
        found: list[bytes | None] = [None] * len(keys)
        for depth, tier in enumerate(self.tiers):
            missing = [i for i, record in enumerate(found) if record is None]
            if not missing:
                break
            answers = tier.get_many([keys[i] for i in missing])
            promoted = []
            for i, record in zip(missing, answers, strict=True):
                if record is not None:
                    found[i] = record
                    promoted.append((keys[i], record))
            for upper in self.tiers[:depth]:
                if promoted:
                    upper.put_many(promoted)
        return found

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def held_run(tier: BlockStore, keys: Sequence[bytes], shard_keys: Sequence[Sequence[bytes]] = ()) -> int:
    """How many leading blocks `tier` holds, block i whole (`keys[i]`) or, when `shard_keys` is given, as
    every one of its shard records (`shard_keys[i]`: kv_store/block_shards.py). One round trip per window
    of CHAIN_WINDOW blocks asks for their whole and shard keys together (what the router's store location
    answers; reads no values)."""
    held = 0
    for start in range(0, len(keys), CHAIN_WINDOW):
        window = list(keys[start : start + CHAIN_WINDOW])
        shards = [list(k) for k in shard_keys[start : start + len(window)]]
        present = tier.contains_many(window + [key for block in shards for key in block])
        offset = len(window)  # the shard answers follow the whole ones, block by block
        for i, whole in enumerate(present[: len(window)]):
            width = len(shards[i]) if shards else 0
            if not (whole or (width and all(present[offset : offset + width]))):
                return held
            offset += width
            held += 1
    return held


class StoreWriter:
    """Writes (key, record) batches to `tiers` on one thread, off the caller's path."""

    def __init__(self, tiers: Sequence[BlockStore], max_queued_batches: int = 64):
        self.tiers = tuple(tiers)
        self.dropped_batches = 0
        self._queue: queue.Queue[tuple[list[tuple[bytes, RecordSource]], bool] | None] = queue.Queue(max_queued_batches)
        self._thread = threading.Thread(target=self._run, name="kv-store-writer", daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[bytes, RecordSource]], only_missing: bool = False) -> None:
        """Queues a batch without waiting; a full queue drops its oldest batch to make room.
        `only_missing`: write only the keys a tier does not hold yet (`BlockStore.put_missing`)."""
        if not items:
            return
        while True:
            try:
                self._queue.put_nowait((items, only_missing))
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                    self._queue.task_done()
                    self.dropped_batches += 1
                except queue.Empty:
                    pass

    def flush(self, timeout_s: float) -> bool:
        """Waits until every queued batch is written; False when `timeout_s` passed first."""
        deadline_s = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline_s:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            try:
                if entry is None:
                    return
                pending, only_missing = entry
                batch = [(key, value if isinstance(value, bytes) else value()) for key, value in pending]
                for tier in self.tiers:
                    try:
                        tier.put_missing(batch) if only_missing else tier.put_many(batch)
                    except Exception:  # a tier's bug must not stop the writer
                        log.exception("kv store write to the %s tier failed", tier.name)
            finally:
                self._queue.task_done()
