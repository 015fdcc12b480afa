"""The global prefix index (interface in base.py): in-process for one router, Redis (one server or a
Redis Cluster) for several."""

from __future__ import annotations

from prefix_index.base import IndexNamespace, PrefixIndex, PrefixIndexUnavailable, PrefixMatch
from prefix_index.connect import make_redis_index
from prefix_index.memory import InProcessPrefixIndex
from prefix_index.publisher import RedisIndexPublisher
from prefix_index.redis_cluster_index import RedisClusterPrefixIndex
from prefix_index.redis_index import RedisPrefixIndex


def make_prefix_index(redis_url: str | None, namespace: IndexNamespace, lease_s: float) -> PrefixIndex:
    """The router's index: Redis when a URL is configured (workers publish), else in-process (it pulls)."""
    if redis_url is None:
        return InProcessPrefixIndex(lease_s)
    return make_redis_index(redis_url, namespace, lease_s)


__all__ = [
    "InProcessPrefixIndex",
    "IndexNamespace",
    "PrefixIndex",
    "PrefixIndexUnavailable",
    "PrefixMatch",
    "RedisClusterPrefixIndex",
    "RedisIndexPublisher",
    "RedisPrefixIndex",
    "make_prefix_index",
    "make_redis_index",
]
