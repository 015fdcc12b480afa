"""The prefix-index tests' fixtures: a private `redis-server` per test (tests/cluster/conftest_redis.py)."""
from tests.cluster.conftest_redis import redis_server  # noqa: F401
