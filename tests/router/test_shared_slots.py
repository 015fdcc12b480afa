"""The router's prefill book shares its in-process index's worker slots, and retires them safely.

Members join, leave (the feeder drops a departed worker's entries a few steps later, as its removal
runs after the membership listener), rejoin under an id whose slot went to someone else meanwhile,
restart, publish blocks, are found dead; loads change through the ledger. After every change the
router's masked choice must equal the exhaustive one, the index must answer exactly what each live
worker published (a reused slot inheriting a departed worker's bits would add blocks), and the index,
the book and the slot registry must pass `check_integrity`, with every slot claimed by exactly the
structures that hold its worker.
"""

from __future__ import annotations

import random

import pytest

from common.kv_events import KVEventBatch
from common.membership import Membership, member_order
from engine.block_hash import hash_blocks
from engine.block_pool import BlockStored
from policies.routing import RouteQuery
from prefix_index.base import PrefixMatch
from prefix_index.memory import InProcessPrefixIndex
from prefix_index.worker_slots import CountedSlots
from sim.drive import run_now
from tests.router.test_routable_loads import CLUSTER, NO_STREAM, NS, Router, member


def publish(index: InProcessPrefixIndex, worker_id: str, epoch: int, hashes) -> None:
    """The worker's next batch of KV events (what the feeder applies): each block stored, in order."""
    cursor = run_now(index.cursor(worker_id))
    last = cursor[1] if cursor is not None and cursor[0] == epoch else 0
    events = tuple((last + i + 1, BlockStored((h,), None, ())) for i, h in enumerate(hashes))
    run_now(index.apply(KVEventBatch(worker_id, epoch, last + len(events), events)))


def truth_matches(held: dict[str, set], hashes) -> list[PrefixMatch]:
    """What the index must answer: each worker's leading run of `hashes`, from what it published."""
    out = []
    for worker_id, blocks in held.items():
        run = 0
        while run < len(hashes) and hashes[run] in blocks:
            run += 1
        if run:
            out.append(PrefixMatch(worker_id, run))
    return sorted(out, key=lambda m: (-m.num_blocks, m.worker_id))


def by_depth(matches) -> list[PrefixMatch]:
    return sorted(matches, key=lambda m: (-m.num_blocks, m.worker_id))


@pytest.mark.parametrize("seed", range(8))
def test_shared_slots_follow_members_joining_and_leaving(seed):
    rng = random.Random(seed)
    ids = range(rng.choice([3, 8, 24]))  # a small id space: ids leave and come back
    index = InProcessPrefixIndex(lease_s=3600)
    slots = index.slots
    assert isinstance(slots, CountedSlots)
    epochs = dict.fromkeys(ids, 1)
    members = {
        m.worker_id: m
        for m in (member("prefill", i, 1) for i in ids)
        if m.worker_id.endswith("-0") or rng.random() < 0.6
    }
    decode = member("decode", 0, 1)
    version = 1

    def membership() -> Membership:
        return Membership(CLUSTER, version, tuple(sorted([*members.values(), decode], key=member_order)))

    router = Router(membership(), index)
    book = router.chooser.loads.prefill
    assert book.slots is slots, "the prefill book shares the index's slots"
    prompts = [[rng.randrange(10**6) + t for t in range(rng.choice([8, 16, 40]))] for _ in range(5)]
    held: dict[str, set] = {}  # worker → the blocks it published in its current epoch (the truth)
    pending: list[tuple[int, str]] = []  # (step due, worker): departures the feeder has not applied yet
    booked: list[tuple[str, str, int]] = []
    slot_users: dict[int, set[str]] = {}  # slot → every worker that ever had it
    decided = 0
    for step in range(250):
        for due, worker_id in [p for p in pending if p[0] <= step]:
            pending.remove((due, worker_id))
            run_now(index.remove_worker(worker_id))
            held.pop(worker_id, None)
        action = rng.random()
        if action < 0.3:  # a member publishes a prompt's leading blocks
            m = rng.choice(list(members.values()))
            prompt = rng.choice(prompts)
            hashes = hash_blocks(NS, prompt[: 4 * rng.randint(1, len(prompt) // 4)])
            publish(index, m.worker_id, m.epoch, hashes)
            held.setdefault(m.worker_id, set()).update(hashes)
        elif action < 0.5:  # load changes through the ledger
            if booked and rng.random() < 0.5:
                request_id, prefill_id, uncached = booked.pop(rng.randrange(len(booked)))
                router.ledger.release(request_id, prefill_id, decode.worker_id, uncached)
            else:
                prefill_id = rng.choice(list(members))
                uncached = rng.choice([0, 16, 64, 512])
                router.ledger.book(f"r{step}", prefill_id, decode.worker_id, uncached, NO_STREAM)
                booked.append((f"r{step}", prefill_id, uncached))
        elif action < 0.55:
            m = rng.choice(list(members.values()))
            router.monitor.mark_dead(m.worker_id, m.epoch)  # out of the book; the index keeps its blocks
        else:  # membership: leave, join (perhaps an id that left), restart
            absent = [i for i in ids if member("prefill", i, 1).worker_id not in members]
            change = rng.random()
            if change < 0.4 and len(members) > 1:
                worker_id = rng.choice(list(members))
                del members[worker_id]  # the index holds its blocks until the feeder's removal runs
                pending.append((step + rng.randint(0, 3), worker_id))
            elif change < 0.8 and absent:
                i = rng.choice(absent)
                epochs[i] += 1
                joined = member("prefill", i, epochs[i])
                for due, worker_id in [p for p in pending if p[1] == joined.worker_id]:
                    pending.remove((due, worker_id))  # its old entries go before its new start publishes
                    run_now(index.remove_worker(worker_id))
                    held.pop(worker_id, None)
                members[joined.worker_id] = joined
            else:  # a restart: its new epoch's first heartbeat drops the old epoch's blocks
                m = rng.choice(list(members.values()))
                i = int(m.worker_id.rpartition("-")[2])
                epochs[i] += 1
                members[m.worker_id] = member("prefill", i, epochs[i])
                run_now(index.heartbeat(m.worker_id, epochs[i]))
                held.pop(m.worker_id, None)
            version += 1
            router.view.apply(membership())
        for slot, worker_id in slots.owners.items():
            slot_users.setdefault(slot, set()).add(worker_id)
        # the checks, after every change
        prompt = rng.choice(prompts)
        cut = prompt[: rng.randint(1, len(prompt))]
        hashes = hash_blocks(NS, cut)
        query = RouteQuery(tuple(hashes), len(cut), 4, repr(cut).encode())
        expected = router.expected(query)
        assert router.actual(query) == expected, f"step {step}"
        decided += expected is not None
        assert by_depth(run_now(index.match(hashes))) == truth_matches(held, hashes), f"step {step}"
        router.chooser.loads.check_integrity()
        run_now(index.check_integrity())
        for worker_id in slots.owners.values():
            holders = {"index"} if run_now(index.cursor(worker_id)) is not None else set()
            holders |= {"book"} if book.has(worker_id) else set()
            claimants = {"index"} if worker_id in slots.claimed_by(index) else set()
            claimants |= {"book"} if worker_id in slots.claimed_by(book) else set()
            assert holders and holders == claimants, f"step {step}: {worker_id} held by {holders}, claims {claimants}"
    assert decided > 150
    assert slots.releases > 0 and any(len(users) > 1 for users in slot_users.values()), "slots were reused"


def test_a_redis_index_leaves_the_book_without_slots():
    """With Redis (one server or a cluster) the index has no masks: the book keeps none, the policy walks."""
    from prefix_index import IndexNamespace, RedisClusterPrefixIndex, RedisPrefixIndex

    index = RedisPrefixIndex("redis://127.0.0.1:1", IndexNamespace("model", 4), 3.0)  # never connected here
    router = Router(Membership(CLUSTER, 1, (member("prefill", 0, 1), member("decode", 0, 1))), index)
    assert index.slots is None and RedisClusterPrefixIndex.slots is None
    assert router.chooser.loads.prefill.slots is None
    router.chooser.loads.check_integrity()
