"""The router's own choice (`WorkerChooser` over `RoutableLoads`) equals the exhaustive choice.

A random fleet changes under the router as it would in service: requests are booked, reach their first
token and end (the ledger), decode streams start and end (the cluster client), workers are found dead
(the monitor), restart, drain, join and leave (membership versions). After every change the router
decides a random prompt, and the decision must equal what the router computed before it kept its
books: the healthy workers listed from the membership, their ledger loads scored one by one
(`ExhaustiveCacheAwarePolicy`), and the decode instance with the fewest streams found by a scan.
"""

from __future__ import annotations

import random
import time
from typing import cast

import pytest

from cluster.client import ClusterClient
from cluster.cluster_view import ClusterView
from cluster.launcher import LaunchedCluster
from common.actor_api import ControllerHandle
from common.config import ClusterConfig
from common.kv_events import KVEventBatch
from common.membership import DRAINING, SERVING, Member, Membership, member_order, same_member
from common.messages import WorkerInfo
from engine.block_hash import HashNamespace, hash_blocks
from engine.block_pool import BlockStored
from policies.routing import NoWorkersError, RouteQuery
from policies.routing.cache_aware import CacheAwarePolicy, ExhaustiveCacheAwarePolicy
from prefix_index.memory import InProcessPrefixIndex
from router.ledger import RouteLedger
from router.stream_state import StreamState
from router.worker_choice import WorkerChooser
from router.worker_monitor import WorkerMonitor
from sim.drive import run_now

CLUSTER = "c1"
NO_STREAM = cast(StreamState, None)  # only admission reads a booking's stream state; routing never does
NS = HashNamespace("model/router-books", 4)


def member(role: str, slot: int, epoch: int, state: str = SERVING) -> Member:
    worker_id = f"{CLUSTER}/{role}-{slot}"
    info = WorkerInfo(worker_id, role, (f"{worker_id}#{epoch}",), 1024, 4, 8, "spec", "model", 4096, 32000, (2,))
    return Member(worker_id, role, epoch, (), info, state)


class Router:
    """A router's routing objects over a membership the test changes (no actors: nothing is called)."""

    def __init__(self, membership: Membership, index: InProcessPrefixIndex):
        no_controller = cast(ControllerHandle, None)  # the view is never started: the test applies memberships
        launched = LaunchedCluster(ClusterConfig(), "", no_controller, membership, owns_controller=False)
        self.view = ClusterView(launched)
        self.monitor = WorkerMonitor(self.view)
        self.ledger = RouteLedger()
        self.client = ClusterClient(self.view)
        self.chooser = WorkerChooser(self.view, CacheAwarePolicy(index), self.monitor, self.ledger, self.client)
        self.exhaustive = ExhaustiveCacheAwarePolicy(index)

    def expected(self, query: RouteQuery):
        """The choice as the router made it by scanning the pools (its code before `RoutableLoads`)."""
        healthy = [m for m in self.view.prefill if self.monitor.is_healthy(m.worker_id)]
        decodes = [m for m in self.view.decode if self.monitor.is_healthy(m.worker_id)]
        if not healthy or not decodes:
            return None
        decision = run_now(self.exhaustive.choose(query, [self.ledger.prefill_load(m.worker_id) for m in healthy]))
        decode = min(decodes, key=lambda d: (self.client.decode_load(d.worker_id), d.worker_id))
        return decision.worker_id, decode.worker_id, decision

    def actual(self, query: RouteQuery):
        try:
            prefill, decode, decision = run_now(self.chooser.choose(query, time.monotonic()))
        except NoWorkersError:
            return None
        for chosen in (prefill, decode):  # the current start of the worker, serving
            current = self.view.membership.get(chosen.worker_id)
            assert current is not None and same_member(chosen, current) and chosen.state == SERVING
        return prefill.worker_id, decode.worker_id, decision


def hold(index: InProcessPrefixIndex, worker_id: str, epoch: int, tokens: list[int]) -> None:
    hashes = hash_blocks(NS, tokens)
    events = tuple((i + 1, BlockStored((h,), None, ())) for i, h in enumerate(hashes))
    run_now(index.apply(KVEventBatch(worker_id, epoch, len(events), events)))


@pytest.mark.parametrize("seed", range(12))
def test_router_choice_equals_the_exhaustive_choice_as_the_fleet_changes(seed):
    rng = random.Random(seed)
    prefill_n, decode_n = rng.choice([(1, 1), (3, 2), (12, 4), (60, 10)])
    members = {m.worker_id: m for m in [member("prefill", i, 1) for i in range(prefill_n)]}
    members |= {m.worker_id: m for m in [member("decode", i, 1) for i in range(decode_n)]}
    version = 1
    index = InProcessPrefixIndex(lease_s=3600)
    prompts = [[rng.randrange(10**6) + t for t in range(rng.choice([8, 16, 40]))] for _ in range(4)]
    for m in members.values():
        if m.role == "prefill":
            for prompt in prompts:
                if rng.random() < 0.4:
                    hold(index, m.worker_id, 1, prompt[: 4 * rng.randint(1, len(prompt) // 4)])
    router = Router(Membership(CLUSTER, version, tuple(sorted(members.values(), key=member_order))), index)
    booked: list[tuple[str, str, str, int, bool]] = []  # (request, prefill, decode, uncached, first token seen)
    decoding: list[str] = []  # decode ids with a stream of the client's
    decided = 0
    for step in range(300):
        action = rng.random()
        if action < 0.3:
            prefill_id = rng.choice([w for w, m in members.items() if m.role == "prefill"])
            decode_id = rng.choice([w for w, m in members.items() if m.role == "decode"])
            uncached = rng.choice([0, 16, 64, 512])
            router.ledger.book(f"r{step}", prefill_id, decode_id, uncached, NO_STREAM)
            booked.append((f"r{step}", prefill_id, decode_id, uncached, False))
        elif action < 0.4 and booked:
            i = rng.randrange(len(booked))
            request_id, prefill_id, decode_id, uncached, first = booked[i]
            if not first:
                router.ledger.first_token(prefill_id, uncached)
                booked[i] = (request_id, prefill_id, decode_id, uncached, True)
        elif action < 0.5 and booked:
            request_id, prefill_id, decode_id, uncached, first = booked.pop(rng.randrange(len(booked)))
            router.ledger.release(request_id, prefill_id, decode_id, 0 if first else uncached)
        elif action < 0.6:
            decode_id = rng.choice([w for w, m in members.items() if m.role == "decode"])
            router.client._count_on(decode_id, 1)  # a stream starts there (what `generate` counts)
            decoding.append(decode_id)
        elif action < 0.65 and decoding:
            router.client._count_on(decoding.pop(rng.randrange(len(decoding))), -1)
        elif action < 0.72:
            m = rng.choice(list(members.values()))
            router.monitor.mark_dead(m.worker_id, m.epoch)  # a request found it dead
        elif action < 0.9:
            m = rng.choice(list(members.values()))
            change = rng.random()
            if change < 0.4:  # restarted: a new epoch, healthy again
                members[m.worker_id] = member(m.role, int(m.worker_id.rpartition("-")[2]), m.epoch + 1)
            elif change < 0.6:
                members[m.worker_id] = member(m.role, int(m.worker_id.rpartition("-")[2]), m.epoch, DRAINING)
            elif change < 0.8 and sum(x.role == m.role for x in members.values()) > 1:
                del members[m.worker_id]
            else:
                slot = max(int(w.rpartition("-")[2]) for w, x in members.items() if x.role == m.role) + 1
                joined = member(m.role, slot, 1)
                members[joined.worker_id] = joined
            version += 1
            router.view.apply(Membership(CLUSTER, version, tuple(sorted(members.values(), key=member_order))))
        prompt = rng.choice(prompts)
        cut = prompt[: rng.randint(1, len(prompt))]
        query = RouteQuery(tuple(hash_blocks(NS, cut)), len(cut), 4, repr(cut).encode())
        expected = router.expected(query)
        assert router.actual(query) == expected, f"step {step}"
        decided += expected is not None
        router.chooser.loads.check_integrity()
    assert decided > 100  # most steps had a routable worker in each pool: the comparison was made


def test_a_router_without_routable_workers_says_which_pool_is_missing():
    prefill, decode = member("prefill", 0, 1), member("decode", 0, 1)
    router = Router(Membership(CLUSTER, 1, (prefill, decode)), InProcessPrefixIndex(lease_s=30))
    query = RouteQuery((), 3, 4, b"abc")
    assert router.actual(query)[:2] == (prefill.worker_id, decode.worker_id)
    router.monitor.mark_dead(decode.worker_id, 1)
    with pytest.raises(NoWorkersError, match="no healthy decode instance"):
        run_now(router.chooser.choose(query, time.monotonic()))
    router.view.apply(Membership(CLUSTER, 2, (member("prefill", 0, 1, DRAINING), member("decode", 0, 2))))
    with pytest.raises(NoWorkersError, match="no healthy prefill worker"):
        run_now(router.chooser.choose(query, time.monotonic()))
    router.view.apply(Membership(CLUSTER, 3, (member("prefill", 0, 2), member("decode", 0, 2))))
    assert router.actual(query)[:2] == (prefill.worker_id, decode.worker_id)
    router.chooser.loads.check_integrity()
