"""Helpers for the cluster tests (the shared Ray session fixture lives in tests/conftest.py)."""
from __future__ import annotations

import asyncio
import os


def run(coro, timeout_s: float = 120.0):
    """Run a coroutine to completion with a bound (tests never hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def pytest_configure(config):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


from tests.cluster.conftest_redis import redis_server  # noqa: E402,F401  (fixture: a private redis-server)
