"""A worker's KV cache events, numbered, buffered off the hot path, read in batches by indexers.

The engine thread appends every `BlockStored` / `BlockRemoved` its block pool emits (a deque append
under a lock: nothing on the hot path waits on a network). Readers — the router's in-process index
pulling over Ray, or the Redis publisher — ask for everything after the last sequence number they
applied and get one `KVEventBatch`. A reader that fell further behind than the buffer holds gets a
`snapshot` instead: the full set of hashes the worker caches now, which replaces what the reader
knew. `epoch` changes on every worker start, so a reader can tell a restarted worker (whose old
entries are all gone) from one it is following.

Events name their medium (`BlockStored.medium`): the pool's come from the engine thread, the host
tier's from the tier's writer thread (kv_store/worker_tiers.py), into this same numbered buffer; a
snapshot lists both.

A reader that has every event can long-poll (`wait_past`) instead of asking again and again: an idle
worker then answers one call per wait bound, not one per polling interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

from engine.block_hash import BlockHash
from engine.block_pool import MEDIUM_HOST, BlockRemoved, BlockStored, KVCacheEvent

DEFAULT_CAPACITY = 65536


@dataclass(frozen=True)
class KVEventBatch:
    """Events `seq > since` of one worker epoch, oldest first; or a snapshot when the reader fell behind.

    `events` pairs each event with its sequence number (1, 2, ... within an epoch, no gaps).
    `snapshot`, when not None, lists every block hash cached in the pool at `last_seq`, and
    `host_snapshot` every hash in the host tier then; `events` is then empty.
    """

    worker_id: str
    epoch: int
    last_seq: int
    events: tuple[tuple[int, KVCacheEvent], ...]
    snapshot: tuple[BlockHash, ...] | None = None
    host_snapshot: tuple[BlockHash, ...] = ()


class KVEventBuffer:
    """Thread-safe: the engine thread and the host tier's writer append, any number of readers read,
    each with its own cursor."""

    def __init__(self, worker_id: str, capacity: int = DEFAULT_CAPACITY, epoch: int | None = None):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        self.worker_id = worker_id
        self.epoch = epoch if epoch is not None else time.time_ns()
        self._events: deque[tuple[int, KVCacheEvent]] = deque(maxlen=capacity)
        self._cached: dict[BlockHash, None] = {}  # insertion-ordered set of what the worker's pool caches now
        self._host: dict[BlockHash, None] = {}  # and of what its host tier holds
        self._last_seq = 0
        self._lock = threading.Lock()
        # Long-polling readers (`wait_past`), on one event loop: `_armed` means one waits and no wake is
        # on its way, so an append wakes them once, not once per event of a step.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._appended: asyncio.Event | None = None
        self._armed = False

    def append(self, event: KVCacheEvent) -> None:
        with self._lock:
            wake, self._armed = self._armed, False
            self._last_seq += 1
            self._events.append((self._last_seq, event))
            held = self._host if event.medium == MEDIUM_HOST else self._cached
            if isinstance(event, BlockStored):
                held.update(dict.fromkeys(event.block_hashes))
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    held.pop(block_hash, None)
            loop, appended = self._loop, self._appended
        if wake and loop is not None and appended is not None:
            loop.call_soon_threadsafe(appended.set)

    async def wait_past(self, seq: int, timeout_s: float) -> None:
        """Returns once `read_since(seq)` has something to give (an event past `seq`, or a snapshot for a
        cursor beyond this epoch's last number), or after `timeout_s`."""
        with self._lock:
            if seq != self._last_seq:
                return
            loop = asyncio.get_running_loop()
            if self._loop is not loop or self._appended is None:
                self._loop, self._appended = loop, asyncio.Event()
            appended = self._appended
            appended.clear()
            self._armed = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(appended.wait(), timeout_s)

    def read_since(self, since_seq: int, max_events: int = 8192, *, epoch: int | None = None) -> KVEventBatch:
        """Events after `since_seq` (at most `max_events`); a snapshot if some were already dropped.

        `since_seq` < 0 asks for a snapshot. `epoch`, when given, is the epoch the cursor belongs to:
        a cursor of another epoch (a reader that followed this worker before it restarted) gets a
        snapshot, as does one beyond this epoch's last sequence number.
        """
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events!r}")
        with self._lock:
            if since_seq > self._last_seq or (epoch is not None and epoch != self.epoch):
                since_seq = -1  # a cursor from another epoch: start over from a snapshot
            oldest = self._events[0][0] if self._events else self._last_seq + 1
            if since_seq + 1 < oldest and since_seq < self._last_seq:
                return KVEventBatch(
                    self.worker_id, self.epoch, self._last_seq, (), tuple(self._cached), tuple(self._host)
                )
            start = len(self._events) - (self._last_seq - since_seq)
            # islice walks the deque once; indexing a deque in a loop is O(n) per item, under the lock
            # the engine thread's append waits on.
            events = tuple(itertools.islice(self._events, start, start + max_events))
            last_seq = events[-1][0] if events else self._last_seq
            return KVEventBatch(self.worker_id, self.epoch, last_seq, events)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._last_seq
