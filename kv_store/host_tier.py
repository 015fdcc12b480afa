"""Bounded host tiers of one worker: records in process memory, or in a memory-mapped local file.

Both evict their least recently used record to make room. A GPU worker's host tier is memory (its
records were copied off the device once, when encoded); a CPU worker's pool already is host memory,
so its further tier is a local file: the page cache keeps what is hot and the disk holds the rest,
without counting against the process's memory.

`on_change(stored_keys, evicted_keys)`, when set, is called after each write that changed what the
tier holds, under the tier's lock (so two threads' calls arrive in the order their changes happened):
a prefill worker publishes them as host-tier KV events (kv_store/worker_tiers.py). It runs on the
writing thread (the tier's writer, or a fetch promoting a store hit), never on the engine's.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from pathlib import Path

from kv_store.base import BlockStore

TierListener = Callable[[list[bytes], list[bytes]], None]  # (stored keys, evicted keys)


class MemoryTier(BlockStore):
    """Records in a dict, at most `capacity_bytes` of values in all."""

    name = "host"

    def __init__(self, capacity_bytes: int):
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"host tier capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        self.stats.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._records: OrderedDict[bytes, bytes] = OrderedDict()
        self.on_change: TierListener | None = None

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            out = []
            for key in keys:
                value = self._records.get(key)
                if value is not None:
                    self._records.move_to_end(key)
                out.append(value)
        found = [value for value in out if value is not None]
        self._count(hits=len(found), misses=len(out) - len(found), read_bytes=sum(map(len, found)))
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        stored = stored_bytes = 0
        stored_keys: list[bytes] = []
        evicted_keys: list[bytes] = []
        with self._lock:
            for key, value in items:
                if len(value) > self.stats.capacity_bytes:
                    continue
                old = self._records.pop(key, None)
                self.stats.used_bytes -= 0 if old is None else len(old)
                while self.stats.used_bytes + len(value) > self.stats.capacity_bytes:
                    dropped_key, dropped = self._records.popitem(last=False)
                    self.stats.used_bytes -= len(dropped)
                    evicted_keys.append(dropped_key)
                self._records[key] = value
                self.stats.used_bytes += len(value)
                stored, stored_bytes = stored + 1, stored_bytes + len(value)
                stored_keys.append(key)
            _notify(self.on_change, stored_keys, evicted_keys, self._records)
        self._count(writes=stored, write_bytes=stored_bytes, evictions=len(evicted_keys))
        return stored

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._records for key in keys]

    def close(self) -> None:
        with self._lock:
            self._records.clear()
            self.stats.used_bytes = 0


class DiskTier(BlockStore):
    """Records in fixed slots of one preallocated file under `directory`, memory-mapped.

    Every record of a worker has the same size (one block of one layout), so the file is an array of
    `slot_bytes` slots and placement is a free list: no fragmentation, no compaction. The file is
    private to this process and removed on `close` (a restarted worker starts with an empty tier; the
    shared store is what outlives a worker).
    """

    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, slot_bytes: int):
        super().__init__()
        if not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ValueError(f"disk tier slot_bytes must be a positive integer, got {slot_bytes!r}")
        num_slots = capacity_bytes // slot_bytes if isinstance(capacity_bytes, int) else 0
        if num_slots < 1:
            raise ValueError(f"disk tier capacity_bytes {capacity_bytes!r} holds no {slot_bytes}-byte block")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"kv-tier-{os.getpid()}-{id(self):x}.bin"
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        self.stats.capacity_bytes = num_slots * slot_bytes
        with open(self.path, "wb") as file:
            file.truncate(self.stats.capacity_bytes)  # sparse: disk is used as slots fill
        self._file = open(self.path, "r+b")  # noqa: SIM115 - lives as long as the tier
        self._map: mmap.mmap | None = mmap.mmap(self._file.fileno(), self.stats.capacity_bytes)
        self._lock = threading.Lock()
        self._slots: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (slot, length), LRU order
        self._free = list(range(num_slots - 1, -1, -1))
        self.on_change: TierListener | None = None

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                where = self._slots.get(key)
                if where is None or self._map is None:
                    out.append(None)
                    continue
                self._slots.move_to_end(key)
                start = where[0] * self.slot_bytes
                out.append(bytes(self._map[start : start + where[1]]))
        found = [value for value in out if value is not None]
        self._count(hits=len(found), misses=len(out) - len(found), read_bytes=sum(map(len, found)))
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        stored = stored_bytes = 0
        stored_keys: list[bytes] = []
        evicted_keys: list[bytes] = []
        with self._lock:
            if self._map is None:
                return 0
            for key, value in items:
                if len(value) > self.slot_bytes:
                    continue
                if key in self._slots:
                    slot, _ = self._slots.pop(key)
                elif self._free:
                    slot = self._free.pop()
                else:
                    dropped_key, (slot, _) = self._slots.popitem(last=False)
                    evicted_keys.append(dropped_key)
                start = slot * self.slot_bytes
                self._map[start : start + len(value)] = value
                self._slots[key] = (slot, len(value))
                stored, stored_bytes = stored + 1, stored_bytes + len(value)
                stored_keys.append(key)
            self.stats.used_bytes = len(self._slots) * self.slot_bytes
            _notify(self.on_change, stored_keys, evicted_keys, self._slots)
        self._count(writes=stored, write_bytes=stored_bytes, evictions=len(evicted_keys))
        return stored

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._slots for key in keys]

    def close(self) -> None:
        with self._lock:
            if self._map is not None:
                self._map.close()
                self._map = None
                self._file.close()
                self.path.unlink(missing_ok=True)
            self._slots.clear()


def _notify(
    listener: TierListener | None, stored_keys: list[bytes], evicted_keys: list[bytes], held: Container[bytes]
) -> None:
    """Tells `listener` the call's net change: a key evicted then stored again by one batch (or stored
    then evicted) is reported once, as what the tier holds now."""
    if listener is None:
        return
    stored = [key for key in dict.fromkeys(stored_keys) if key in held]
    evicted = [key for key in dict.fromkeys(evicted_keys) if key not in held]
    if stored or evicted:
        listener(stored, evicted)
