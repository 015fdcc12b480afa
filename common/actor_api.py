"""The remote interfaces of the cluster's actors, and the typed handles every caller uses to reach them.

Each actor class implements one Protocol here, checked by mypy where the class is defined:
`PrefillWorkerApi` (prefill_worker/worker.py), `DecodeRankApi` (decode_worker/worker.py) and
`ControllerApi` (cluster/controller.py). Callers never call `.remote(...)` on an actor themselves: they
hold a handle (`PrefillHandle`, `DecodeRankHandle`, `ControllerHandle`) whose methods have the
Protocol's signatures and are the one place a Ray call is made. So a reader (and mypy, and an IDE) can
follow a request from the router into a worker: `member.prefill_api.prefill(...)` is
`PrefillWorker.prefill`. The messages these calls carry are the frozen dataclasses of
common/messages.py; docs/architecture.md ("Request lifecycle") tells the order of the calls.

Handles hold a Ray actor handle and nothing else: they pickle with the membership that carries them.
Each method returns the call's `ObjectRef` (await it, or `ray.get` it from synchronous code); a dead
actor surfaces as Ray's own `RayActorError` and an exception the actor raised as `RayTaskError`, as on
a raw call. tests/common/test_actor_api.py holds every handle to its Protocol's methods and parameters.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from common.kv_events import KVEventBatch
from common.messages import (
    FilledBlocks,
    GenerateRequest,
    Liveness,
    PrefillQueue,
    PrefillResult,
    TokenUpdate,
    WorkerInfo,
    WorkerStats,
)
from common.traffic import TrafficCounts
from kvtransfer.handoff import HandoffTarget
from kvtransfer.session import HandoffStats

if TYPE_CHECKING:
    from ray import ObjectRef

    from common.membership import Member, Membership, MembershipDelta

# What a prefill worker's `prefill` stream yields, in order: queue changes, the first token, and (when
# the sequence continues on a decode instance) the hand-off's figures.
PrefillEvent = PrefillQueue | PrefillResult | HandoffStats


class WorkerApi(Protocol):
    """What every worker actor (a prefill worker, each rank of a decode instance) answers."""

    async def ready(self) -> WorkerInfo:
        """Once loaded: what the worker serves (the controller waits for it before it joins membership)."""
        ...

    async def ping(self) -> Liveness:
        """Liveness from the actor's event loop, never its engine: a busy worker answers at once."""
        ...

    async def set_membership(self, membership: Membership) -> None:
        """The controller's latest membership (peers to reach; channels to departed peers close)."""
        ...

    async def stats(self) -> WorkerStats:
        """Load and the newest engine steps (decode: rank 0 only)."""
        ...

    async def check_integrity(self) -> dict:
        """The block pool's integrity check and what it still holds (tests, operators)."""
        ...

    async def kv_tier_stats(self) -> dict[str, dict[str, int]]:
        """Counters of the worker's KV tiers (kv_store/): per tier and for the worker; {} without tiers."""
        ...

    async def debug_signal(self, signum: int) -> None:
        """Fault injection: send `signum` to the actor's own process (chaos, tests)."""
        ...

    async def debug_set_step_delay(self, seconds: float) -> None:
        """Fault injection for tests: sleep before each engine step."""
        ...


class PrefillWorkerApi(WorkerApi, Protocol):
    def prefill(self, request: GenerateRequest, decode: Member | None, owner: str) -> AsyncIterator[PrefillEvent]:
        """Computes the request's prompt: yields its queue changes, its first token, then (when it
        continues on `decode`) the hand-off's statistics once the decode instance adopted it. `owner`
        is the caller's id on the decode instance (its `poll` gets the tokens)."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Stops the request wherever it is (queued, computing, handing off) and frees what it holds."""
        ...

    async def export_prefix(
        self,
        requester_id: str,
        requester_peer: str,
        request_id: str,
        token_ids: tuple[int, ...],
        tenant: str,
        start_block: int,
        num_blocks: int,
    ) -> int:
        """Holder side of a prefix pull: sends the prefix blocks it still holds; returns how many."""
        ...

    async def receive_prefix(self, holder_peer: str, request_id: str) -> None:
        """Requester side of a prefix pull: receives the blocks a holder announced."""
        ...

    async def read_kv_events(self, since_seq: int, max_wait_s: float = 0.0) -> KVEventBatch:
        """The prefix-cache events after `since_seq` (the in-process prefix index pulls them); with
        `max_wait_s`, waits up to that long for one when there is none yet (a long poll)."""
        ...


class DecodeRankApi(WorkerApi, Protocol):
    """One rank of a decode instance. Rank 0 takes the instance's calls (reserve, adopt, cancel, poll,
    stats); every rank receives its part of the KV (expect, receive_kv, cancel_expected)."""

    async def reserve(self, request_id: str, num_tokens: int, owner: str) -> HandoffTarget:
        """Allocates blocks for `num_tokens` of incoming KV on every rank (raises DecodeFull when the
        pool has no room now, HandoffFailed when the owner is gone)."""
        ...

    async def adopt(self, request: GenerateRequest, first_token_id: int) -> None:
        """Continues a request whose KV arrived on every rank."""
        ...

    async def cancel(self, request_id: str) -> None:
        """Aborts a running request or drops its reservation."""
        ...

    async def poll(self, owner: str, max_wait_s: float) -> list[TokenUpdate]:
        """Everything produced for `owner`'s requests since its last poll (long-poll)."""
        ...

    async def expect(self, request_id: str, block_ids: tuple[int, ...], deadline_s: float) -> None:
        """Registers a transfer this rank will receive into `block_ids` (rank 0 tells its followers)."""
        ...

    async def receive_kv(self, prefill_peer: str, request_id: str) -> None:
        """Receives this rank's part of a request's KV, announced by the prefill worker sending it."""
        ...

    async def cancel_expected(self, request_id: str) -> None:
        """Forgets an expected transfer once nothing can still write into its blocks."""
        ...

    async def store_filled_blocks(self, blocks: FilledBlocks) -> None:
        """Ranks > 0, from rank 0: blocks the last steps filled; this rank stores its KV heads of them."""
        ...

    async def debug_set_receive_delay(self, seconds: float) -> None:
        """Fault injection for tests: stall each KV receive."""
        ...


class ControllerApi(Protocol):
    """The cluster's controller (one named, detached actor per cluster): desired state and membership."""

    async def membership(self) -> Membership: ...

    async def watch(self, known_version: int, timeout_s: float) -> Membership:
        """Long-poll: the membership once its version differs from `known_version`, else after the timeout."""
        ...

    async def watch_delta(self, cluster_id: str, known_version: int, timeout_s: float) -> Membership | MembershipDelta:
        """As `watch`, answered as a `MembershipDelta` from `known_version` when the controller still has it."""
        ...

    async def wait_ready(self, timeout_s: float) -> Membership:
        """Returns once every desired worker serves; raises naming what could not start."""
        ...

    async def progress(self) -> str: ...

    async def cluster_config(self) -> dict:
        """The running cluster's config (as scaled) as plain data."""
        ...

    async def check_join(self, given: dict) -> None:
        """Raises ConfigError naming each key a joining command gave that differs from this cluster's."""
        ...

    async def scale(self, role: str, replicas: int) -> None: ...

    async def report_traffic(self, router_id: str, counts: TrafficCounts) -> bool: ...

    async def planner_status(self) -> dict | None: ...

    async def kill_worker(self, worker_id: str, rank: int = 0) -> bool:
        """Chaos: SIGKILL one rank of a worker. False: no such worker."""
        ...

    async def shutdown(self) -> None: ...

    async def ping(self) -> str: ...

    async def pid(self) -> int: ...


# ---- the handles: a Ray call per method, nothing else ------------------------------------------------
def _hostname(_actor: object) -> str:
    import socket

    return socket.gethostname()


@dataclass(frozen=True)
class _Handle:
    actor: Any  # the Ray actor handle (ray.actor.ActorHandle)


@dataclass(frozen=True)
class WorkerHandle(_Handle):
    """Any worker actor: the calls every worker answers (`WorkerApi`); the controller's view of a rank."""

    def ready(self) -> ObjectRef[WorkerInfo]:
        return self.actor.ready.remote()

    def ping(self) -> ObjectRef[Liveness]:
        return self.actor.ping.remote()

    def set_membership(self, membership: Membership) -> ObjectRef[None]:
        return self.actor.set_membership.remote(membership)

    def stats(self) -> ObjectRef[WorkerStats]:
        return self.actor.stats.remote()

    def check_integrity(self) -> ObjectRef[dict]:
        return self.actor.check_integrity.remote()

    def kv_tier_stats(self) -> ObjectRef[dict[str, dict[str, int]]]:
        return self.actor.kv_tier_stats.remote()

    def debug_signal(self, signum: int) -> ObjectRef[None]:
        return self.actor.debug_signal.remote(signum)

    def debug_set_step_delay(self, seconds: float) -> ObjectRef[None]:
        return self.actor.debug_set_step_delay.remote(seconds)

    def hostname(self) -> ObjectRef[str]:
        """The host (on KubeRay: the pod) the actor runs on, asked of the actor itself (a Ray built-in call)."""
        return self.actor.__ray_call__.remote(_hostname)


@dataclass(frozen=True)
class PrefillHandle(WorkerHandle):
    async def prefill(self, request: GenerateRequest, decode: Member | None, owner: str) -> AsyncIterator[PrefillEvent]:
        stream = self.actor.prefill.options(num_returns="streaming").remote(request, decode, owner)
        async for ref in stream:
            yield await ref

    def abort(self, request_id: str) -> ObjectRef[bool]:
        return self.actor.abort.remote(request_id)

    def export_prefix(
        self,
        requester_id: str,
        requester_peer: str,
        request_id: str,
        token_ids: tuple[int, ...],
        tenant: str,
        start_block: int,
        num_blocks: int,
    ) -> ObjectRef[int]:
        return self.actor.export_prefix.remote(
            requester_id, requester_peer, request_id, token_ids, tenant, start_block, num_blocks
        )

    def receive_prefix(self, holder_peer: str, request_id: str) -> ObjectRef[None]:
        return self.actor.receive_prefix.remote(holder_peer, request_id)

    def read_kv_events(self, since_seq: int, max_wait_s: float = 0.0) -> ObjectRef[KVEventBatch]:
        if max_wait_s > 0:
            return self.actor.read_kv_events.remote(since_seq, max_wait_s)
        return self.actor.read_kv_events.remote(since_seq)  # the call a worker of any release takes


@dataclass(frozen=True)
class DecodeRankHandle(WorkerHandle):
    def reserve(self, request_id: str, num_tokens: int, owner: str) -> ObjectRef[HandoffTarget]:
        return self.actor.reserve.remote(request_id, num_tokens, owner)

    def adopt(self, request: GenerateRequest, first_token_id: int) -> ObjectRef[None]:
        return self.actor.adopt.remote(request, first_token_id)

    def cancel(self, request_id: str) -> ObjectRef[None]:
        return self.actor.cancel.remote(request_id)

    def poll(self, owner: str, max_wait_s: float) -> ObjectRef[list[TokenUpdate]]:
        return self.actor.poll.remote(owner, max_wait_s)

    def expect(self, request_id: str, block_ids: tuple[int, ...], deadline_s: float) -> ObjectRef[None]:
        return self.actor.expect.remote(request_id, block_ids, deadline_s)

    def receive_kv(self, prefill_peer: str, request_id: str) -> ObjectRef[None]:
        return self.actor.receive_kv.remote(prefill_peer, request_id)

    def cancel_expected(self, request_id: str) -> ObjectRef[None]:
        return self.actor.cancel_expected.remote(request_id)

    def store_filled_blocks(self, blocks: FilledBlocks) -> ObjectRef[None]:
        return self.actor.store_filled_blocks.remote(blocks)

    def debug_set_receive_delay(self, seconds: float) -> ObjectRef[None]:
        return self.actor.debug_set_receive_delay.remote(seconds)


@dataclass(frozen=True)
class ControllerHandle(_Handle):
    def membership(self) -> ObjectRef[Membership]:
        return self.actor.membership.remote()

    def watch(self, known_version: int, timeout_s: float) -> ObjectRef[Membership]:
        return self.actor.watch.remote(known_version, timeout_s)

    def watch_delta(
        self, cluster_id: str, known_version: int, timeout_s: float
    ) -> ObjectRef[Membership | MembershipDelta]:
        return self.actor.watch_delta.remote(cluster_id, known_version, timeout_s)

    def wait_ready(self, timeout_s: float) -> ObjectRef[Membership]:
        return self.actor.wait_ready.remote(timeout_s)

    def progress(self) -> ObjectRef[str]:
        return self.actor.progress.remote()

    def cluster_config(self) -> ObjectRef[dict]:
        return self.actor.cluster_config.remote()

    def check_join(self, given: dict) -> ObjectRef[None]:
        return self.actor.check_join.remote(given)

    def scale(self, role: str, replicas: int) -> ObjectRef[None]:
        return self.actor.scale.remote(role, replicas)

    def report_traffic(self, router_id: str, counts: TrafficCounts) -> ObjectRef[bool]:
        return self.actor.report_traffic.remote(router_id, counts)

    def planner_status(self) -> ObjectRef[dict | None]:
        return self.actor.planner_status.remote()

    def kill_worker(self, worker_id: str, rank: int = 0) -> ObjectRef[bool]:
        return self.actor.kill_worker.remote(worker_id, rank)

    def shutdown(self) -> ObjectRef[None]:
        return self.actor.shutdown.remote()

    def ping(self) -> ObjectRef[str]:
        return self.actor.ping.remote()

    def pid(self) -> ObjectRef[int]:
        return self.actor.pid.remote()
