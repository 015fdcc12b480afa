"""One rank of a decode instance (a Ray actor). A decode instance is `tp_size` of these.

Every rank holds its shard of the model and its KV heads, and receives its part of each hand-off
(`receive_kv`). Rank 0 also runs the scheduler and sampler: it reserves blocks (`reserve`, once the
prefill is done), adopts sequences once their KV is in (`adopt`), continues them in a continuous
batch, and collects each step's tokens for the whole batch into an outbox that each router drains
with one `poll` call per round trip. When each of these is called: docs/architecture.md, Request
lifecycle and KV hand-off.

Rank 0 sweeps in the background: a reservation whose KV did not arrive within its lease is dropped
(its router is told), and requests of a router that stopped polling (its process died) are aborted,
so no block outlives the caller that asked for it. Liveness (`ping`) and load (`stats`) never wait
for an engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from common import tracing
from common.actor_api import DecodeRankApi, DecodeRankHandle
from common.config import ClusterConfig
from common.logs import configure_logging_from_env
from common.membership import Membership
from common.messages import FilledBlocks, GenerateRequest, Liveness, TokenUpdate, WorkerInfo, WorkerStats
from common.worker_telemetry import WorkerTelemetry
from decode_worker.outbox import Outbox
from decode_worker.rank_setup import RankSetup, build_rank
from decode_worker.rank_tier_stats import OtherRankTierStats
from decode_worker.shard_store import FollowerShards, LeaderShards
from decode_worker.tp_group import TensorParallelEngine
from decode_worker.trace import DecodeSpans
from engine.block_hash import spec_fingerprint
from engine.block_pool import KVCacheEvent
from engine.engine_loop import EngineLoop
from engine.heap import freeze_startup_heap
from engine.llm_engine import LLMEngine
from kv_store.block_shards import rank_heads, writes_shards
from kv_store.metrics import KVTierCollector
from kv_store.worker_tiers import WorkerKVTiers
from kvtransfer.handoff import HandoffTarget, RankTarget
from kvtransfer.receiver import KVReceiver
from kvtransfer.session import DecodeFull, HandoffFailed

LEASE_GRACE_S = 2.0  # clocks of two hosts may differ a little; blocks are freed only after this
SWEEP_INTERVAL_S = 0.5
OWNER_TIMEOUT_MAX_S = 10.0  # a router that has not polled for this long (or the lease, if shorter) is gone
FORGET_OWNER_FACTOR = 10


class DecodeRank:
    def __init__(
        self,
        instance_id: str,
        epoch: int,
        rank: int,
        config: dict,
        model_dir: str,
        store_host: str,
        store_port: int,
        followers: tuple = (),
    ):
        configure_logging_from_env()  # --log-level / --log-format of the serve command
        self.config = ClusterConfig.from_dict(config)
        self.instance_id, self.epoch, self.rank = instance_id, epoch, rank
        self.group_id = f"{instance_id}@{epoch}"  # this start's id: its TP group and transport ids
        self.peer_id = rank_peer_id(self.group_id, rank)
        self.outbox = Outbox()
        self.telemetry = WorkerTelemetry(instance_id, "decode", self.config, model_dir) if rank == 0 else None
        if rank == 0:  # the instance's spans are rank 0's (it adopts and streams for all ranks)
            tracing.configure(self.config.otlp_traces_endpoint, "splitserve-decode")
        self.spans = DecodeSpans(instance_id)
        self.kv_tiers: WorkerKVTiers | None = None  # set below when this instance stores its blocks
        self.leader_shards: LeaderShards | None = None  # rank 0 of a TP instance storing its blocks
        self.shards: FollowerShards | None = None  # a rank > 0 storing its heads (set by build_rank)
        self._followers = [DecodeRankHandle(follower) for follower in followers]
        self.setup: RankSetup = build_rank(self, self.config, model_dir, store_host, store_port)
        if self.config.decode_stores_blocks and self.setup.loop is not None:
            engine = self.setup.loop.engine
            tp_size, num_kv_heads = self.config.decode.tp_size, engine.model_config.num_kv_heads
            heads = None if tp_size == 1 else rank_heads(0, num_kv_heads, tp_size)
            # TP: only blocks a step filled are stored, as shards; nothing is already stored under their keys
            storage = engine.runner.kv_cache
            self.kv_tiers = WorkerKVTiers(self.config.kv_store, storage, engine.kv, tp_size == 1, heads=heads)
            writers: list[DecodeRankHandle] = []
            if isinstance(engine, TensorParallelEngine):
                writers = [f for r, f in enumerate(self._followers, 1) if writes_shards(r, num_kv_heads, tp_size)]
                self.leader_shards = LeaderShards(self.kv_tiers, engine, writers, self.config.block_size)
            if self.telemetry is not None:  # the instance's series: every rank writing shards counts
                others = OtherRankTierStats(writers) if writers else None
                collector = KVTierCollector(instance_id, "decode", self.kv_tiers, others)
                self.telemetry.metrics.registry.register(collector)
        self.receiver = KVReceiver(self.setup.transport, self.setup.runner.kv_cache)
        self._recv_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-recv")
        self._leases: dict[str, float] = {}  # rank 0: reserved, not yet adopted → deadline
        # rank 0: request ids cancelled before they were reserved (a router's cleanup can overtake a
        # dead prefill worker's last reserve call) → until when a reserve for them is refused
        self._cancelled: dict[str, float] = {}
        self.membership = Membership("", 0)
        self.owner_timeout_s = min(OWNER_TIMEOUT_MAX_S, self.config.handoff_lease_s)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep()) if rank == 0 else None
        self._cancels: set[asyncio.Task] = set()  # the loop holds tasks weakly: these must not vanish mid-way
        freeze_startup_heap()  # this actor's process is ours: later full collections skip the startup heap

    async def ready(self) -> WorkerInfo:
        cfg = self.setup.model_config
        peers = tuple(rank_peer_id(self.group_id, r) for r in range(self.config.decode.tp_size))
        return WorkerInfo(
            self.instance_id,
            "decode",
            peers,
            self.setup.num_blocks,
            self.config.block_size,
            cfg.num_kv_heads,
            spec_fingerprint(),
            cfg.identity,
            self.setup.max_model_len,
            cfg.vocab_size,
            cfg.eos_token_ids,
            epoch=self.epoch,
        )

    async def ping(self) -> Liveness:
        loop = self.setup.loop
        ok = loop.running if loop is not None else self.setup.follower_alive()
        error = loop.error if loop is not None else None
        return Liveness(self.instance_id, self.epoch, ok, None if error is None else repr(error))

    async def set_membership(self, membership: Membership) -> None:
        """The controller's latest membership: channels to peers that left are closed."""
        if membership.version <= self.membership.version and membership.cluster_id == self.membership.cluster_id:
            return
        gone = self.membership.peer_ids() - membership.peer_ids()
        self.membership = membership
        for peer in gone:
            self.setup.transport.forget_peer(peer)

    # ---- every rank -------------------------------------------------------------------------------
    async def expect(self, request_id: str, block_ids: tuple[int, ...], deadline_s: float) -> None:
        if self.shards is not None:  # before anything can write into them (decode_worker/shard_store.py)
            self.shards.before_import(block_ids)
        self.receiver.expect(request_id, block_ids, deadline_s)

    async def store_filled_blocks(self, blocks: FilledBlocks) -> None:
        """Ranks > 0: rank 0 names blocks the last steps filled; this rank stores its heads of them."""
        if self.shards is not None:
            self.shards.on_filled(blocks)

    def follower_shards(self, runner) -> FollowerShards | None:
        """Called by build_rank on ranks > 0: what stores this rank's heads of filled blocks, or None."""
        config = self.config
        num_kv_heads = runner.model.config.num_kv_heads
        if not config.decode_stores_blocks or not writes_shards(self.rank, num_kv_heads, config.decode.tp_size):
            return None
        heads = rank_heads(self.rank, num_kv_heads, config.decode.tp_size)
        self.kv_tiers = WorkerKVTiers(config.kv_store, runner.kv_cache, None, heads=heads)
        self.shards = FollowerShards(self.kv_tiers, config.block_size)
        return self.shards

    async def receive_kv(self, prefill_peer: str, request_id: str) -> None:
        """Announced by the prefill worker right before it sends this rank's part of the KV."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._recv_pool, self.receiver.receive, prefill_peer, request_id)

    async def cancel_expected(self, request_id: str) -> None:
        await asyncio.get_running_loop().run_in_executor(
            None, self.receiver.cancel, request_id, self.config.handoff_lease_s + LEASE_GRACE_S
        )
        self.receiver.forget(request_id)

    # ---- rank 0 ---------------------------------------------------------------------------------
    async def reserve(self, request_id: str, num_tokens: int, owner: str) -> HandoffTarget:
        """Allocates blocks for `num_tokens` of incoming KV on every rank for router `owner` (whose `poll`
        gets the request's tokens). Raises DecodeFull when the pool has no room now, HandoffFailed
        when the owner is gone."""
        if owner in self.outbox.stale_owners(self.owner_timeout_s):
            raise HandoffFailed("reserve", f"router {owner} stopped polling this instance")
        if request_id in self._cancelled:
            raise HandoffFailed("reserve", f"{request_id!r} was cancelled")
        try:
            block_ids = await self._call(lambda engine: engine.reserve(request_id, num_tokens))
        except MemoryError as err:
            raise DecodeFull(str(err)) from None
        self.outbox.assign(request_id, owner)
        deadline_s = time.time() + self.config.handoff_lease_s
        self._leases[request_id] = deadline_s
        self.receiver.expect(request_id, block_ids, deadline_s)
        await asyncio.gather(*(f.expect(request_id, block_ids, deadline_s) for f in self._followers))
        return HandoffTarget(
            self.instance_id, self._rank_targets(), block_ids, deadline_s, self.setup.runner.kv_cache.layout
        )

    async def adopt(self, request: GenerateRequest, first_token_id: int) -> None:
        """Continues a request whose prompt KV arrived (every rank acked the prefill worker)."""
        rid = request.request_id
        await asyncio.get_running_loop().run_in_executor(None, self.receiver.wait, rid, 1.0)
        if self._leases.pop(rid, None) is None:
            raise HandoffFailed("adopt", f"{rid!r} was cancelled or its lease ended")
        self.receiver.forget(rid)
        tokens = tuple(request.prompt_token_ids) + tuple(request.output_token_ids) + (first_token_id,)
        await self._call(
            lambda engine: engine.adopt(
                rid,
                tokens,
                len(request.prompt_token_ids),
                request.params,
                priority=request.priority,
                tenant_salt=request.tenant,
            )
        )
        await asyncio.gather(*(f.cancel_expected(rid) for f in self._followers))
        self.spans.adopted(request)

    async def cancel(self, request_id: str) -> None:
        """Abort a running request, or drop a reservation (after no rank can still write into it); a
        reserve for the id that arrives later (it was overtaken) is refused for the lease's length."""
        self._leases.pop(request_id, None)
        self._cancelled[request_id] = time.time() + self.config.handoff_lease_s + LEASE_GRACE_S
        await asyncio.gather(
            self.cancel_expected(request_id), *(f.cancel_expected(request_id) for f in self._followers)
        )
        await self._call(lambda engine: _abort_or_release(engine, request_id))
        self.outbox.forget(request_id)
        self.spans.cancelled(request_id)

    async def poll(self, owner: str, max_wait_s: float) -> list[TokenUpdate]:
        """Everything produced for `owner`'s requests since its last poll, waiting up to `max_wait_s`."""
        updates = await self.outbox.drain(owner, max_wait_s)
        self.spans.delivered(updates)
        return updates

    async def check_integrity(self) -> dict:
        """Rank 0: the block pool's integrity check and what it still holds. Ranks > 0 hold no pool of
        their own (rank 0 allocates for all): their `num_sequences` is the transfers still expected."""
        if self.setup.loop is None:
            return {
                "num_blocks": self.setup.num_blocks,
                "num_free_blocks": self.setup.num_blocks,
                "num_sequences": self.receiver.num_expected,
            }

        def check(engine: LLMEngine) -> dict:
            engine.kv.check_integrity()
            return {
                "num_blocks": engine.num_blocks,
                "num_free_blocks": engine.kv.num_free_blocks,
                "num_sequences": len(engine.seqs),
                "num_grammar_matchers": len(engine.structured.matchers),
            }

        return await self._call(check)

    async def stats(self) -> WorkerStats:
        """Rank 0: load, recent engine steps and reservations waiting for their KV (see WorkerTelemetry)."""
        if self.telemetry is None:
            raise RuntimeError(f"{self.peer_id}: only rank 0 keeps statistics")
        stats = self.telemetry.stats(self._loop, len(self._leases))
        return stats if self.kv_tiers is None else dataclasses.replace(stats, kv_tiers=self.kv_tiers.status())

    async def debug_signal(self, signum: int) -> None:
        """Fault injection (chaos, tests): send `signum` to this actor's own process (SIGKILL: no cleanup)."""
        os.kill(os.getpid(), signum)

    async def debug_set_step_delay(self, seconds: float) -> None:
        """Fault injection for tests (rank 0): sleep `seconds` before each engine step."""
        self._loop.step_delay_s = seconds

    async def debug_set_receive_delay(self, seconds: float) -> None:
        """Fault injection for tests: stall each KV receive by `seconds`."""
        self.receiver.delay_s = seconds

    def on_kv_event(self, event: KVCacheEvent) -> None:
        """Engine thread (rank 0): a block of a running sequence filled; the KV tiers get a copy."""
        if self.leader_shards is not None:
            self.leader_shards.on_kv_event(event)
        elif self.kv_tiers is not None:
            self.kv_tiers.on_kv_event(event)

    async def kv_tier_stats(self) -> dict[str, dict[str, int]]:
        """Counters of this instance's KV tiers (blocks written for migrations); {} without them."""
        return {} if self.kv_tiers is None else self.kv_tiers.stats()

    def shutdown(self) -> None:
        if self.leader_shards is not None:
            self.leader_shards.close()
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.telemetry is not None:
            self.telemetry.close()
        self.setup.close()
        self._recv_pool.shutdown(wait=False, cancel_futures=True)

    def _rank_targets(self) -> tuple[RankTarget, ...]:
        cfg, size = self.setup.model_config, self.config.decode.tp_size
        heads_per_rank = max(1, cfg.num_kv_heads // size)
        replicas = max(1, size // cfg.num_kv_heads)  # KV heads replicated when ranks outnumber them
        return tuple(
            RankTarget(
                rank_peer_id(self.group_id, r),
                (r // replicas) * heads_per_rank,
                (r // replicas) * heads_per_rank + heads_per_rank,
            )
            for r in range(size)
        )

    async def _sweep(self) -> None:
        """Rank 0: drop expired reservations and the requests of routers that are gone."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            now_s = time.time()
            for rid in [rid for rid, deadline in self._leases.items() if now_s > deadline + LEASE_GRACE_S]:
                self._leases.pop(rid, None)
                self.outbox.push(
                    TokenUpdate(
                        rid,
                        (),
                        (),
                        error=f"the KV of {rid!r} did not arrive within the {self.config.handoff_lease_s:.0f} s lease",
                    )
                )
                self._cancel_soon(rid)
            for rid in [rid for rid, until in self._cancelled.items() if now_s > until]:
                del self._cancelled[rid]
            self._drop_gone_owners()

    def _drop_gone_owners(self) -> None:
        """Abort what routers that stopped polling own (told in their outbox, should they come back);
        forget such a router entirely once it has been silent for FORGET_OWNER_FACTOR timeouts."""
        stale = self.outbox.stale_owners(self.owner_timeout_s)
        for rid in self.outbox.requests_of(stale):
            self.outbox.push(TokenUpdate(rid, (), (), error="its router stopped polling this decode instance"))
            self._leases.pop(rid, None)
            self._cancel_soon(rid)
        for owner in self.outbox.stale_owners(self.owner_timeout_s * FORGET_OWNER_FACTOR):
            self.outbox.drop_owner(owner)

    def _cancel_soon(self, request_id: str) -> None:
        task = asyncio.ensure_future(self.cancel(request_id))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    @property
    def _loop(self) -> EngineLoop:
        if self.setup.loop is None:
            raise RuntimeError(f"{self.peer_id}: only rank 0 runs the engine loop")
        return self.setup.loop

    async def _call(self, fn):
        return await asyncio.wrap_future(self._loop.call(fn))


def rank_peer_id(group_id: str, rank: int) -> str:
    """The transport id of one rank of one start of a decode instance."""
    return f"{group_id}/rank{rank}"


def _abort_or_release(engine: LLMEngine, request_id: str) -> None:
    if not engine.abort_request(request_id) and engine.kv.has(request_id):
        engine.release(request_id)  # a reservation that was never adopted


if TYPE_CHECKING:  # mypy holds the actor to its remote interface
    _implements: type[DecodeRankApi] = DecodeRank
