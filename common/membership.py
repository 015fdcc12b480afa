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
