"""What each engine step did and how long it took: the raw material of the router's cost models.

The engine loop appends one `StepRecord` per step (on its thread); workers hand recent records to
the router with their stats, which fits prefill time against tokens and decode step time against
batch size and context (admission control), and exports them as metrics.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple


class StepRecord(NamedTuple):
    # A field named like tuple.index, which it shadows (mypy: assignment); only ever read as a field.
    index: int  # type: ignore[assignment]  # 1, 2, ... per engine: readers skip what they have seen
    duration_s: float
    num_tokens: int  # tokens computed this step (prefill chunks + one per decoding sequence)
    num_seqs: int  # sequences in the batch
    context_tokens: int  # tokens of KV the step's attention read, over all its sequences


class StepLog:
    """Bounded, thread-safe: the engine thread appends, any thread reads."""

    def __init__(self, capacity: int = 1024):
        self._records: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._count = 0

    def append(self, duration_s: float, num_tokens: int, num_seqs: int, context_tokens: int) -> StepRecord:
        with self._lock:
            self._count += 1
            record = StepRecord(self._count, duration_s, num_tokens, num_seqs, context_tokens)
            self._records.append(record)
            return record

    def recent(self, limit: int = 128) -> tuple[StepRecord, ...]:
        """The newest `limit` records, oldest first."""
        with self._lock:
            return tuple(self._records)[-limit:]
