"""The interface every KV block tier implements, and the counters each one keeps.

Contract (tests/kv_store/test_store_contract.py runs it against every implementation):

- Keys and values are bytes. A value is a whole block record; tiers never look inside it.
- `get_many` answers one entry per key, in order: the stored bytes or None. A tier that cannot answer
  (server down, timeout) answers None for what it could not read and counts an error: to a request a
  store in trouble looks like a cold cache, never like a failure.
- `put_many` stores what it can and returns how many it stored; a full bounded tier evicts its least
  recently used entries to make room; a value larger than the whole tier is not stored.
- Thread safety: every method may be called from any thread (the engine thread reads, a writer
  thread writes).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StoreStats:
    """Counters of one tier since it was opened (monotonic, for metrics and `splitserve status`)."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_bytes: int = 0
    read_bytes: int = 0
    errors: int = 0
    evictions: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0  # 0: bounded by the store itself (Redis `maxmemory`), not by us

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


class BlockStore(ABC):
    """One tier of KV block storage. `name` labels it in metrics ("host", "disk", "redis")."""

    name: str

    def __init__(self) -> None:
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value stored under each key, or None (a miss, or a read this tier could not do)."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Stores (key, value) pairs; returns how many were stored."""

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (False where this tier could not tell)."""

    def put_missing(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Stores only the pairs whose key is absent (one round trip to ask, then the values that are
        needed: a decode instance re-offers prompt blocks a prefill worker stored already)."""
        if not items:
            return 0
        present = self.contains_many([key for key, _ in items])
        return self.put_many([item for item, have in zip(items, present, strict=True) if not have])

    def close(self) -> None:  # noqa: B027 - tiers without resources have nothing to close
        """Releases connections and files; the tier answers misses afterwards."""

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for field, delta in deltas.items():
                setattr(self.stats, field, getattr(self.stats, field) + delta)
