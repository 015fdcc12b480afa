"""The prefix-index tests' fixtures: a private `redis-server` per test (tests/cluster/conftest_redis.py)
and a 3-shard Redis Cluster per module (tests/redis_cluster.py)."""
from __future__ import annotations

import subprocess

import pytest

from tests.cluster.conftest_redis import redis_server  # noqa: F401
from tests.redis_cluster import REDIS_CLI, RedisClusterNodes


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A running 3-shard cluster (`.url`, `.kill(i)`) whose live shards keep serving when one dies."""
    with RedisClusterNodes(3, workdir=str(tmp_path_factory.mktemp("redis-cluster"))) as nodes:
        for node in nodes.nodes:
            subprocess.run([REDIS_CLI, "-p", str(node.port), "config", "set", "cluster-require-full-coverage", "no"],
                           check=True, capture_output=True, timeout=10)
        yield nodes
