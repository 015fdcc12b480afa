"""The router's index feeder over real Ray actors: a long poll brings an event as soon as it is stored,
and a worker of an earlier release (whose `read_kv_events` takes no wait bound) is still followed.

The actors hold a real `KVEventBuffer` and answer `read_kv_events` as a prefill worker does; the view is
a membership the test applies (no controller), as in test_routable_loads.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest

from cluster.cluster_view import ClusterView
from cluster.launcher import LaunchedCluster
from common.actor_api import ControllerHandle
from common.config import ClusterConfig
from common.kv_events import KVEventBatch, KVEventBuffer
from common.membership import Member, Membership
from common.messages import WorkerInfo
from engine.block_hash import HashNamespace, hash_blocks
from engine.block_pool import BlockStored
from prefix_index.memory import InProcessPrefixIndex
from router.index_feeder import IndexFeeder

NS = HashNamespace("model/index-feeder", 4)
FIRST, SECOND = list(range(8)), list(range(100, 108))  # two block runs, stored one after the other


class EventsWorker:
    """A prefill worker's KV-event side, as `PrefillWorker.read_kv_events` answers it."""

    def __init__(self, worker_id: str):
        self.kv_events = KVEventBuffer(worker_id, epoch=1)

    def store(self, tokens: list[int]) -> None:
        self.kv_events.append(BlockStored(tuple(hash_blocks(NS, tokens)), None, tuple(tokens)))

    async def read_kv_events(self, since_seq: int, max_wait_s: float = 0.0) -> KVEventBatch:
        if max_wait_s > 0:
            await self.kv_events.wait_past(since_seq, max_wait_s)
        return self.kv_events.read_since(since_seq)


class EarlierReleaseWorker(EventsWorker):
    """A worker from before the long poll: `read_kv_events(since_seq)` only."""

    async def read_kv_events(self, since_seq: int) -> KVEventBatch:  # type: ignore[override]
        return self.kv_events.read_since(since_seq)


def _member(actor, worker_id: str) -> Member:
    info = WorkerInfo(worker_id, "prefill", (f"{worker_id}#1",), 1024, 4, 8, "spec", "model", 4096, 32000, (2,))
    return Member(worker_id, "prefill", 1, (actor,), info)


async def _held(index: InProcessPrefixIndex, worker_id: str, tokens: list[int]) -> bool:
    hashes = hash_blocks(NS, tokens)
    matches = await index.match(hashes)
    return any(m.worker_id == worker_id and m.num_blocks == len(hashes) for m in matches)


async def _wait_held(index: InProcessPrefixIndex, worker_id: str, tokens: list[int], timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not await _held(index, worker_id, tokens):
        assert time.monotonic() < deadline_s, f"blocks stored on {worker_id} never reached the index"
        await asyncio.sleep(0.005)


async def _feed_and_store(actor, worker_id: str, *, max_wait_s: float, interval_s: float) -> float:
    """Starts a feeder on a worker holding one block run, waits for the index to hold it, stores a second
    run; returns the seconds until the index holds that one too."""
    await actor.store.remote(FIRST)  # the feeder's first pull has something to bring at once
    membership = Membership("c1", 1, (_member(actor, worker_id),))
    view = ClusterView(LaunchedCluster(ClusterConfig(), "", cast(ControllerHandle, None), membership, False))
    index = InProcessPrefixIndex(lease_s=60.0)
    feeder = IndexFeeder(view, index, interval_s=interval_s, timeout_s=30.0, max_wait_s=max_wait_s)
    feeder.start()
    try:
        await _wait_held(index, worker_id, FIRST, timeout_s=60.0)
        await asyncio.sleep(0.2)  # the next pull is waiting on the worker (or between polls)
        await actor.store.remote(SECOND)
        stored_s = time.monotonic()
        await _wait_held(index, worker_id, SECOND, timeout_s=60.0)
        return time.monotonic() - stored_s
    finally:
        await feeder.close()


@pytest.fixture(scope="module")
def actors(ray_session):
    current = ray_session.remote(EventsWorker).options(num_cpus=0).remote("c1/prefill-0")
    earlier = ray_session.remote(EarlierReleaseWorker).options(num_cpus=0).remote("c1/prefill-1")
    ray_session.get([current.__ray_ready__.remote(), earlier.__ray_ready__.remote()], timeout=120)
    yield current, earlier
    for actor in (current, earlier):
        ray_session.kill(actor)


def test_a_long_poll_brings_a_stored_block_without_waiting_for_its_bound(actors):
    current, _ = actors
    # Each pull waits up to 20 s on the idle worker: only the wake-up on append brings the run in time.
    seconds = asyncio.run(_feed_and_store(current, "c1/prefill-0", max_wait_s=20.0, interval_s=0.0))
    assert seconds < 10.0


def test_a_worker_of_an_earlier_release_is_polled_instead(actors):
    _, earlier = actors
    seconds = asyncio.run(_feed_and_store(earlier, "c1/prefill-1", max_wait_s=20.0, interval_s=0.05))
    assert seconds < 10.0  # polled every 50 ms, not held for the 20 s wait bound it cannot take
