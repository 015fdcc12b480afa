"""Redis fixtures for cluster tests: a private `redis-server` per test (fault tests kill and restart
it; starting one takes a few milliseconds). Made visible to tests/cluster by tests/cluster/conftest.py."""
from __future__ import annotations

import pytest

from tests.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A running RedisServer on a free 127.0.0.1 port (`.url`, `.kill()`, `.restart()`, `.pause()`)."""
    server = RedisServer(workdir=str(tmp_path / "redis")).start()
    yield server
    server.kill()
