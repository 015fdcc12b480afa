"""Publishes a prefill worker's KV events into the Redis prefix index, off the engine's path.

Runs on its own daemon thread with its own asyncio loop. The engine only ever appends to the
`KVEventBuffer` (a deque append under a lock); this thread reads the buffer and talks to Redis, so a
slow or dead Redis can delay the index but never a prefill step.

Each cycle (every `interval_s`): read the worker's cursor from Redis; read the buffer after it (a
snapshot when Redis knows nothing of this epoch — first start, Redis restarted, lease expired — or
when the buffer dropped events the cursor still needs); apply; otherwise heartbeat. Reading the
cursor from Redis every cycle is what makes resync automatic: whatever Redis lost, the next cycle
sees it and repairs it. While Redis is unreachable it retries with exponential backoff (capped),
logs one warning per outage and one line when it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from urllib.parse import urlsplit

from common.kv_events import KVEventBuffer
from prefix_index.base import IndexNamespace, PrefixIndex, PrefixIndexUnavailable
from prefix_index.connect import make_redis_index

log = logging.getLogger(__name__)

MAX_BATCHES_PER_CYCLE = 16  # bounds one cycle when far behind; the next cycle continues


class RedisIndexPublisher:
    """`start()` once, `stop()` once. Thread-safe: only `stop()` crosses into the publisher's thread."""

    def __init__(
        self,
        buffer: KVEventBuffer,
        url: str,
        namespace: IndexNamespace,
        lease_s: float,
        interval_s: float = 0.05,
        *,
        max_backoff_s: float = 2.0,
        timeout_s: float = 1.0,
    ):
        if interval_s <= 0 or max_backoff_s < interval_s or lease_s <= interval_s:
            raise ValueError("need 0 < interval_s <= max_backoff_s and interval_s < lease_s")
        self.buffer = buffer
        self.interval_s = interval_s
        self.max_backoff_s = max_backoff_s
        self._index_args = (url, namespace, lease_s, timeout_s)
        self._where = _redact(url)
        self._loop = asyncio.new_event_loop()
        self._wake = asyncio.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._thread_main, name=f"index-publisher-{buffer.worker_id}", daemon=True
        )
        self.published_seq = 0  # last seq of this epoch known to be in Redis (for stats and tests)
        self.outages = 0  # outages seen so far (each logged once)
        self.superseded = False  # a newer epoch of this worker id owns its entries

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> RedisIndexPublisher:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join for at most `timeout_s` (a call in flight ends within its own timeout)."""
        self._stopping.set()
        with contextlib.suppress(RuntimeError):  # the loop already finished and closed
            self._loop.call_soon_threadsafe(self._wake.set)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("prefix-index publisher of %s did not stop within %.1f s", self.buffer.worker_id, timeout_s)

    def _thread_main(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        url, namespace, lease_s, timeout_s = self._index_args
        index = make_redis_index(url, namespace, lease_s, timeout_s=timeout_s)
        delay_s, outage_since = self.interval_s, None
        try:
            while not self._stopping.is_set():
                try:
                    await self._sync(index)
                except Exception as err:  # any failure: keep the thread alive, retry
                    if outage_since is None:
                        outage_since = time.monotonic()
                        self.outages += 1
                        level = logging.WARNING if isinstance(err, PrefixIndexUnavailable) else logging.ERROR
                        log.log(
                            level,
                            "prefix index at %s: %s: %s; retrying with backoff, then resyncing",
                            self._where,
                            type(err).__name__,
                            err,
                            exc_info=level == logging.ERROR,
                        )
                    delay_s = min(delay_s * 2, self.max_backoff_s)
                else:
                    if outage_since is not None:
                        log.info(
                            "prefix index at %s reachable again after %.1f s; resynced",
                            self._where,
                            time.monotonic() - outage_since,
                        )
                    delay_s, outage_since = self.interval_s, None
                await self._sleep(delay_s)
        finally:
            await index.close()

    async def _sync(self, index: PrefixIndex) -> None:
        """Bring Redis up to the buffer: from Redis's cursor for this worker, or from a snapshot."""
        buffer = self.buffer
        cursor = await index.cursor(buffer.worker_id)
        if cursor is not None and cursor[0] > buffer.epoch:
            # A newer start of this worker id publishes: ours would only be ignored, snapshot after
            # snapshot. Say so once and keep watching: if that one's lease ends, ours resyncs.
            if not self.superseded:
                log.warning(
                    "worker %s: a newer epoch (%d > %d) publishes to the prefix index; this one pauses while it does",
                    buffer.worker_id,
                    cursor[0],
                    buffer.epoch,
                )
            self.superseded = True
            return
        self.superseded = False
        since_seq = cursor[1] if cursor is not None and cursor[0] == buffer.epoch else -1
        for _ in range(MAX_BATCHES_PER_CYCLE):
            batch = buffer.read_since(since_seq)
            if batch.snapshot is None and not batch.events:
                await index.heartbeat(buffer.worker_id, buffer.epoch)
                return
            await index.apply(batch)
            since_seq = self.published_seq = batch.last_seq

    async def _sleep(self, delay_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), delay_s)


def _redact(url: str) -> str:
    """The URL without credentials, for logs."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"
