"""Membership deltas at fleet size: hundreds of simulated watchers follow the controller's feed.

A watch answer is the change since the watcher's version (or the whole membership when the feed no
longer holds that version); one answer brings any watcher to the current version; views converge.
"""

from __future__ import annotations

import asyncio
import pickle
import random

import pytest

from cluster.cluster_view import follow
from cluster.membership_feed import MembershipFeed
from common.membership import DRAINING, SERVING, Member, Membership, MembershipDelta, member_order
from common.messages import WorkerInfo

CLUSTER = "c1"


def member(role: str, slot: int, epoch: int, state: str = SERVING) -> Member:
    worker_id = f"{CLUSTER}/{role}-{slot}"
    info = WorkerInfo(worker_id, role, (f"{worker_id}#{epoch}",), 1024, 16, 8, "spec", "model", 4096, 32000, (2,))
    return Member(worker_id, role, epoch, (), info, state)


def key(membership: Membership) -> list[tuple]:
    return [(m.worker_id, m.epoch, m.state) for m in membership.members]


class Fleet:
    """A controller's pools changing at random: restarts (new epochs), drains, joins and leaves."""

    def __init__(self, rng: random.Random, prefill: int, decode: int):
        self.rng = rng
        self.members = {m.worker_id: m for m in [member("prefill", i, 1) for i in range(prefill)]
                        + [member("decode", i, 1) for i in range(decode)]}
        self.version = 1

    def membership(self) -> Membership:
        return Membership(CLUSTER, self.version, tuple(sorted(self.members.values(), key=member_order)))

    def change(self) -> Membership:
        for _ in range(self.rng.randint(1, 3)):
            old = self.rng.choice(list(self.members.values()))
            roll = self.rng.random()
            slot = int(old.worker_id.rsplit("-", 1)[1])
            if roll < 0.5:
                self.members[old.worker_id] = member(old.role, slot, old.epoch + 1)
            elif roll < 0.7:
                self.members[old.worker_id] = member(old.role, slot, old.epoch, DRAINING)
            elif roll < 0.85 and len(self.members) > 2:
                del self.members[old.worker_id]
            else:
                new_slot = max(int(w.rsplit("-", 1)[1]) for w in self.members if f"/{old.role}-" in w) + 1
                self.members[f"{CLUSTER}/{old.role}-{new_slot}"] = member(old.role, new_slot, 1)
        self.version += 1
        return self.membership()


@pytest.mark.parametrize("seed", range(5))
def test_a_delta_from_any_held_version_gives_the_current_membership_exactly(seed):
    async def main():
        fleet = Fleet(random.Random(seed), 40, 20)
        feed = MembershipFeed(fleet.membership(), history_versions=16)
        seen = [fleet.membership()]
        for _ in range(30):
            feed.publish(fleet.change())
            seen.append(feed.current)
        for old in seen:
            answer = feed.delta_from(CLUSTER, old.version)
            if old.version > feed.current.version - 16:
                assert isinstance(answer, MembershipDelta) and answer.base_version == old.version
                assert key(follow(old, answer)) == key(feed.current)
            else:  # missed more versions than the feed holds: the whole membership
                assert answer is feed.current
        assert feed.delta_from("other-cluster", feed.current.version - 1) is feed.current
    asyncio.run(main())


def test_hundreds_of_watchers_converge_each_answer_bringing_them_current():
    """200 watchers long-poll while a 200-worker fleet changes 30 times; a tenth are slow and miss more
    versions than the feed holds (they get the whole membership). After the last change every watcher
    holds it after one more answer; deltas are a small fraction of the membership's size."""
    rng = random.Random(3)

    async def main():
        fleet = Fleet(rng, 120, 80)
        feed = MembershipFeed(fleet.membership(), history_versions=8)
        views = [fleet.membership()] * 200
        answers = {"delta": 0, "whole": 0}
        sizes = {"delta": [], "whole": []}
        stop, done = asyncio.Event(), asyncio.Event()

        async def watcher(i: int) -> None:
            slow = i % 10 == 0
            while not stop.is_set():
                answer = await feed.watch_delta(CLUSTER, views[i].version, timeout_s=0.05)
                kind = "delta" if isinstance(answer, MembershipDelta) else "whole"
                answers[kind] += 1
                if len(sizes[kind]) < 20:
                    sizes[kind].append(len(pickle.dumps(answer)))
                views[i] = follow(views[i], answer)
                assert views[i].version == feed.current.version  # current after every answer
                if slow:  # misses 10 versions: more than the feed holds
                    await lag(views[i].version + 10)

        async def lag(until_version: int) -> None:
            while feed.current.version < until_version and not done.is_set():  # noqa: ASYNC110 - a lagging watcher
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(watcher(i)) for i in range(len(views))]
        for _ in range(30):
            feed.publish(fleet.change())
            await asyncio.sleep(0.005)
        final = feed.current
        done.set()
        await asyncio.sleep(0.3)  # one more round trip each
        assert all(key(view) == key(final) for view in views)
        stop.set()
        await asyncio.gather(*tasks)
        assert answers["delta"] > 10 * answers["whole"] > 0
        assert max(sizes["delta"]) * 10 < min(sizes["whole"])  # a change of 1-3 members vs 200 members
    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_delta_applied_to_another_version_is_refused_and_changes_no_view():
    async def main():
        fleet = Fleet(random.Random(1), 4, 2)
        feed = MembershipFeed(fleet.membership())
        v1 = feed.current
        feed.publish(fleet.change())
        v2 = feed.current
        feed.publish(fleet.change())
        delta = feed.delta_from(CLUSTER, v1.version)
        assert isinstance(delta, MembershipDelta)
        with pytest.raises(ValueError, match="applied to version"):
            delta.apply(v2)
        assert follow(v2, delta) is v2  # the watcher asks again from its own version
        assert key(follow(v1, delta)) == key(feed.current)
    asyncio.run(main())
