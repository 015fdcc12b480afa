"""A real router on loopback over a real Ray cluster, for the router, SDK, CLI and load-test tests.

The router's grpc.aio server runs on an event loop of its own thread (tests are synchronous and talk
to it through the SDK, like any client would). `router_stack` is shared by a module's tests; tests
that need other settings start their own with `start_router`.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, replace

import pytest

from common.config import ClusterConfig, PoolConfig, RouterConfig
from cluster.launcher import LaunchedCluster, launch
from tests.factories import TinySpec

SMALL_POOL = PoolConfig(num_cpus=0.5, num_kv_blocks=256, threads=1)


class LoopThread:
    """An asyncio loop on a daemon thread; `call(coro)` runs a coroutine there and waits (bounded)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="router-loop", daemon=True)
        self.thread.start()

    def call(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class RouterStack:
    cluster: LaunchedCluster
    server: object  # router.server.RouterServer
    loop: LoopThread
    config: ClusterConfig

    @property
    def target(self) -> str:
        return self.server.address

    def check_workers_clean(self, timeout_s: float = 15.0) -> None:
        """Every worker's pool passes its integrity check and holds no request's blocks (waits for
        asynchronous releases, bounded)."""
        from tests.router.cleanliness import wait_workers_clean

        wait_workers_clean(self.cluster, timeout_s)

    def stop(self) -> None:
        try:
            self.loop.call(self.server.stop(grace_s=1.0))
        finally:
            self.loop.close()
            self.cluster.shutdown()


def router_config(**router_overrides) -> ClusterConfig:
    overrides = {"port": 0, "http_port": 0, **router_overrides}
    return ClusterConfig(prefill=SMALL_POOL, decode=SMALL_POOL, ready_timeout_s=90.0,
                         router=replace(RouterConfig(), **overrides))


def start_router(model_dir, config: ClusterConfig | None = None) -> RouterStack:
    from router.server import RouterServer

    config = config or router_config()
    cluster = launch(config, str(model_dir))
    loop = LoopThread()
    try:
        server = loop.call(RouterServer.start(cluster, config))
    except BaseException:
        loop.close()
        cluster.shutdown()
        raise
    return RouterStack(cluster, server, loop, config)


@pytest.fixture(scope="package")
def router_stack(ray_session, checkpoint):
    """One default 1P1D stack per test package (router, loadtest): starting one costs ~12 s on 2 cores,
    and the modules that use it leave it as they found it (a step delay a test sets, it resets)."""
    stack = start_router(checkpoint(TinySpec()))
    yield stack
    stack.stop()


@pytest.fixture(scope="package")
def router_target(router_stack) -> str:
    """"127.0.0.1:PORT" of a running router (1 prefill + 1 decode over the tiny Llama checkpoint)."""
    return router_stack.target
