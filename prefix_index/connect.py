"""The Redis-backed index a URL names: standalone (`redis://`, `rediss://`, `unix://`) or a cluster
(`redis+cluster://HOST:PORT[,HOST:PORT...]`; forms in common/redis_url.py)."""

from __future__ import annotations

from common.redis_url import parse_redis_url
from prefix_index.base import IndexNamespace, PrefixIndex
from prefix_index.redis_cluster_index import RedisClusterPrefixIndex
from prefix_index.redis_index import RedisPrefixIndex


def make_redis_index(url: str, namespace: IndexNamespace, lease_s: float, *, timeout_s: float = 1.0) -> PrefixIndex:
    target = parse_redis_url(url)
    if target.cluster:
        return RedisClusterPrefixIndex(target, namespace, lease_s, timeout_s=timeout_s)
    return RedisPrefixIndex(url, namespace, lease_s, timeout_s=timeout_s)
