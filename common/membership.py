"""Membership: the live workers of a cluster as the controller publishes them (plain data, no Ray calls).

The controller (`cluster/controller.py`) is the only writer. Every change — a worker ready, dead,
draining or gone — makes a new `Membership` with a higher `version`; routers follow it with a
long-poll (`ClusterView`) and route only to members that are `SERVING`. A `DRAINING` member takes no
new requests but finishes the ones it has (routers keep streaming from it). Workers get it pushed
too, to reach their peers (prefix pulls) and to drop transport channels of peers that left. The rest
of the control plane: docs/architecture.md, Control plane.

Worker ids are stable per pool slot ("<cluster>/prefill-0", "<cluster>/decode-1"); every start of a
slot gets a new `epoch`, and everything that must not outlive one start (actor, transport peer ids,
tensor-parallel group, prefix-index entries) is keyed by it.

Watchers at fleet size (hundreds of routers) are sent `MembershipDelta`s: what changed between the
version a watcher holds and the current one (members that joined or changed, ids that left), so a
watch answer grows with the change, not with the fleet. A delta applies only to the exact version it
was computed from; a watcher too far behind (older than the controller's history) gets the whole
`Membership` instead. Either way one answer brings the watcher to the current version.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.actor_api import DecodeRankHandle, PrefillHandle
from common.messages import WorkerInfo

SERVING = "serving"
DRAINING = "draining"
ROLES = ("prefill", "decode")


@dataclass(frozen=True, eq=False)
class Member:
    """One worker: a prefill actor, or a decode instance of `tp_size` rank actors (rank 0 drives it)."""

    worker_id: str
    role: str
    epoch: int
    ranks: tuple  # Ray actor handles, rank 0 first
    info: WorkerInfo
    state: str = SERVING
    restarts: int = 0  # replacements of this slot so far

    @property
    def actor(self):
        """The raw Ray handle of the actor that takes this worker's calls (a decode instance's rank 0).
        Product code calls through the typed handles below (common/actor_api.py)."""
        return self.ranks[0]

    @property
    def prefill_worker(self) -> PrefillHandle:
        """This prefill worker's typed handle (`PrefillWorkerApi`)."""
        return PrefillHandle(self.ranks[0])

    @property
    def decode_instance(self) -> DecodeRankHandle:
        """The typed handle of this decode instance's rank 0, which takes the instance's calls."""
        return DecodeRankHandle(self.ranks[0])

    @property
    def decode_ranks(self) -> tuple[DecodeRankHandle, ...]:
        """Typed handles of every rank of this decode instance, rank 0 first."""
        return tuple(DecodeRankHandle(rank) for rank in self.ranks)

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    @property
    def peer_ids(self) -> tuple[str, ...]:
        """Transport ids of this start of the worker (one per rank)."""
        return self.info.peer_ids


@dataclass(frozen=True)
class Membership:
    cluster_id: str
    version: int
    members: tuple[Member, ...] = ()

    def serving(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role and m.state == SERVING]

    @property
    def prefill(self) -> list[Member]:
        return self.serving("prefill")

    @property
    def decode(self) -> list[Member]:
        return self.serving("decode")

    def get(self, worker_id: str) -> Member | None:
        return next((m for m in self.members if m.worker_id == worker_id), None)

    def peer_ids(self) -> frozenset[str]:
        return frozenset(peer for m in self.members for peer in m.peer_ids)


def member_order(member: Member) -> tuple[int, int, str]:
    """The controller's publication order: role (prefill first), then the pool slot (the id's number)."""
    _, _, tail = member.worker_id.rpartition("-")
    return (ROLES.index(member.role), int(tail) if tail.isdigit() else -1, member.worker_id)


def same_member(a: Member, b: Member) -> bool:
    """The same start of the same worker in the same state (what a change of membership is made of)."""
    return (a.worker_id, a.epoch, a.state, a.restarts) == (b.worker_id, b.epoch, b.state, b.restarts)


@dataclass(frozen=True)
class MembershipDelta:
    """`version` as a change of `base_version`: members that joined or changed, ids that left."""

    cluster_id: str
    base_version: int
    version: int
    upserts: tuple[Member, ...] = ()
    removed: tuple[str, ...] = ()

    def apply(self, base: Membership) -> Membership:
        """The membership at `version`; ValueError when `base` is not the version this delta is from."""
        if base.cluster_id != self.cluster_id or base.version != self.base_version:
            raise ValueError(
                f"delta {self.base_version}->{self.version} of {self.cluster_id} applied to "
                f"version {base.version} of {base.cluster_id}"
            )
        gone = set(self.removed) | {m.worker_id for m in self.upserts}
        kept = [m for m in base.members if m.worker_id not in gone]
        return Membership(self.cluster_id, self.version, tuple(sorted([*kept, *self.upserts], key=member_order)))


def membership_delta(old: Membership, new: Membership) -> MembershipDelta:
    """What turns `old` into `new` (same cluster): the members new or changed, and the ids gone."""
    before = {m.worker_id: m for m in old.members}
    after = {m.worker_id for m in new.members}
    upserts = tuple(m for m in new.members if m.worker_id not in before or not same_member(before[m.worker_id], m))
    removed = tuple(w for w in before if w not in after)
    return MembershipDelta(new.cluster_id, old.version, new.version, upserts, removed)
