"""The shared KV store on Redis: one server, or a Redis Cluster with blocks spread over its shards.

Keys carry no hash tag, so a cluster places each block by its own key's slot and a model's blocks
spread evenly over the shards; a read of a chain groups its keys per shard in one pipeline (redis-py's
cluster pipeline). Eviction is the server's: run it with `maxmemory` and `maxmemory-policy
allkeys-lru`, and the store keeps the blocks most recently written or read.

Redis in trouble costs hits, never a request: every call has a socket timeout, and after a failure
the store answers misses and drops writes without calling Redis for `retry_after_s`, so a dead server
adds no latency per request while it is down; the first call after the pause tries again, and a
restarted server simply fills again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

import redis
from redis.cluster import ClusterNode, RedisCluster

from common.redis_url import RedisTarget, parse_redis_url
from kv_store.base import BlockStore

log = logging.getLogger(__name__)
MGET_CHUNK = 32  # keys per MGET on one server: bounded replies (a block record is tens of KB to MBs)


class RedisBlockStore(BlockStore):
    name = "redis"

    def __init__(self, url: str, *, timeout_s: float = 1.0, retry_after_s: float = 1.0, field: str = "kv_store.url"):
        super().__init__()
        self.target: RedisTarget = parse_redis_url(url, field)
        self._where = "redis cluster" if self.target.cluster else "redis"
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._paused_until_s = 0.0
        self._lock = threading.Lock()
        self._client: redis.Redis | RedisCluster | None = None

    # ---- BlockStore -----------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._call(lambda client: self._get(client, keys))
        out: list[bytes | None] = list(values) if values is not None else [None] * len(keys)
        found = [value for value in out if value is not None]
        self._count(hits=len(found), misses=len(out) - len(found), read_bytes=sum(map(len, found)))
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0
        if self._call(lambda client: self._put(client, items)) is None:
            return 0
        self._count(writes=len(items), write_bytes=sum(len(value) for _, value in items))
        return len(items)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        answers = self._call(lambda client: self._exists(client, keys))
        return [bool(answer) for answer in answers] if answers is not None else [False] * len(keys)

    def close(self) -> None:
        self._drop_client()

    def _drop_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(redis.RedisError, OSError):  # closing a connection to a dead server
                client.close()

    def ping(self) -> bool:
        """Whether the store answers now (for health and `splitserve status`)."""
        return self._call(lambda client: client.ping()) is not None

    # ---- internals ------------------------------------------------------------------------------
    def _get(self, client, keys: Sequence[bytes]) -> list[bytes | None]:
        if isinstance(client, RedisCluster):
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return pipe.execute()
        out: list[bytes | None] = []
        for start in range(0, len(keys), MGET_CHUNK):
            out.extend(client.mget(list(keys[start : start + MGET_CHUNK])))
        return out

    @staticmethod
    def _exists(client, keys: Sequence[bytes]) -> list[int]:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return pipe.execute()

    @staticmethod
    def _put(client, items: Sequence[tuple[bytes, bytes]]) -> bool:
        pipe = client.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value)
        pipe.execute()
        return True

    def _call(self, fn):
        """fn(client), or None when Redis is paused or fails (the failure pauses it)."""
        if time.monotonic() < self._paused_until_s:
            return None
        try:
            return fn(self._connected())
        except (redis.RedisError, OSError) as err:
            self._paused_until_s = time.monotonic() + self.retry_after_s
            self._count(errors=1)
            log.warning(
                "kv store %s: %s: %s; serving misses for %.1f s",
                self._where,
                type(err).__name__,
                err,
                self.retry_after_s,
            )
            self._drop_client()
            return None

    def _connected(self) -> redis.Redis | RedisCluster:
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _connect(self) -> redis.Redis | RedisCluster:
        timeout_s = self.timeout_s
        if not self.target.cluster:
            return redis.Redis.from_url(self.target.url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        nodes = [ClusterNode(host, port) for host, port in self.target.seeds]
        return RedisCluster(
            startup_nodes=nodes,
            ssl=self.target.tls,
            cluster_error_retry_attempts=1,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
