"""One Ray session per test run (PLATFORM.md: init ~2.5 s, shutdown ~1.3 s), started inside the
sandbox the test runner provides, with Ray's files under a short temporary directory."""
from __future__ import annotations

import asyncio
import os
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    ray.init(num_cpus=8, include_dashboard=False, namespace="splitserve", _temp_dir=temp_dir,
             configure_logging=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1",
                                                                "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


def run(coro, timeout_s: float = 120.0):
    """Run a coroutine to completion with a bound (tests never hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def pytest_configure(config):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
