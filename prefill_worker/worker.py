"""The prefill worker: a Ray actor that computes prompts and hands their KV blocks to decode.

It owns an engine in the prefill role (batched chunked prefill under a token budget, local prefix
reuse). A router makes one call per request, `prefill(request, decode, owner)`, a streaming call
that yields whether the request waits in the queue or for its prefix pull (`PrefillQueue`, only
when it does), the first token (`PrefillResult`) as soon as it is sampled and then, for a sequence
that continues on decode, the hand-off's `HandoffStats` once the decode instance adopted it (the
whole path: docs/architecture.md, Request lifecycle). The hand-off itself is a
`kvtransfer.session.HandoffSession`; this actor only adapts it: the engine's pins, the sender
thread, the decode instance's actors. Prefix pulls from a peer are `export_prefix` /
`receive_prefix` (prefill_worker/prefix_pull.py). Callers awaiting a first token are answered from
the engine thread by prefill_worker/first_token.py.

Liveness (`ping`) and load (`stats`) are answered from the actor's event loop and the engine loop's
last snapshot, never by waiting for an engine step: a busy worker never looks dead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from common import tracing
from common.actor_api import PrefillHandle, PrefillWorkerApi
from common.config import ClusterConfig
from common.kv_events import KVEventBatch, KVEventBuffer
from common.logs import configure_logging_from_env
from common.membership import Member, Membership
from common.messages import GenerateRequest, Liveness, PrefillResult, WorkerInfo, WorkerStats
from common.worker_telemetry import WorkerTelemetry
from engine.block_hash import spec_fingerprint
from engine.block_pool import KVCacheEvent
from engine.engine_loop import EngineLoop
from engine.heap import freeze_startup_heap
from engine.llm_engine import LLMEngine
from engine.step_updates import Handoff
from kv_store.metrics import KVTierCollector
from kv_store.worker_tiers import WorkerKVTiers
from kvtransfer.handoff import HandoffTarget, send_sequence_kv
from kvtransfer.session import HandoffFailed, HandoffSession, HandoffStats, KVSender
from kvtransfer.torch_dist import TorchDistTransport
from prefill_worker.decode_endpoint import RayDecodeEndpoint
from prefill_worker.first_token import FirstTokenWaiters
from prefill_worker.first_token import RequestAborted as RequestAborted
from prefill_worker.prefix_pull import PrefixExporter, PrefixPuller, pull_peer_id, pull_table_id
from prefill_worker.store_fetch import StoreFetcher
from prefill_worker.trace import PrefillTrace


class PrefillWorker:
    def __init__(self, worker_id: str, epoch: int, config: dict, model_dir: str, store_host: str, store_port: int):
        configure_logging_from_env()  # --log-level / --log-format of the serve command
        cluster_config = ClusterConfig.from_dict(config)
        self.worker_id, self.epoch = worker_id, epoch
        self.peer_id = f"{worker_id}@{epoch}"  # transport id of this start: never reused by a later one
        self.request_timeout_s = cluster_config.request_timeout_s
        self.kv_events = KVEventBuffer(worker_id)  # read by prefix indexers, off the engine thread
        self.engine = LLMEngine(cluster_config.engine_config("prefill", model_dir), on_kv_event=self._on_kv_event)
        self.index_publisher = _start_publisher(self.kv_events, cluster_config, self.engine)
        self.telemetry = WorkerTelemetry(worker_id, "prefill", cluster_config, model_dir)
        tracing.configure(cluster_config.otlp_traces_endpoint, "splitserve-prefill")
        self.transport = TorchDistTransport(self.peer_id, store_host, store_port)
        self.first_tokens = FirstTokenWaiters(self.engine, self.telemetry.metrics)
        self._sessions: dict[str, HandoffSession | None] = {}  # first token out, hand-off not over yet
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-sender")
        self.kv_sender = KVSender(self._sender)
        self.loop = EngineLoop(
            self.engine, self.first_tokens.on_updates, name=f"{worker_id}-engine", on_step=self.telemetry.on_step
        ).start()
        self.membership = Membership("", 0)
        self.puller = PrefixPuller(
            worker_id,
            self.peer_id,
            store_host,
            store_port,
            self.engine,
            self.loop.call,
            self._find_prefill,
            cluster_config.prefix_pull_timeout_s,
            self.telemetry.metrics,
        )
        self.exporter = PrefixExporter(
            self.peer_id,
            self.transport,
            self.engine,
            self.loop.call,
            self._sender,
            self._find_prefill,
            cluster_config.prefix_pull_timeout_s,
            self.telemetry.metrics,
        )
        self.store_fetcher: StoreFetcher | None = None
        if cluster_config.kv_store.enabled:  # KV tiers beyond the pool: write cached blocks, fetch missing ones
            tiers = WorkerKVTiers(
                cluster_config.kv_store,
                self.engine.runner.kv_cache,
                self.engine.kv,
                decode_tp_size=cluster_config.decode.tp_size,  # reads a TP decode instance's shard records too
            )
            tiers.publish_host_events(self.kv_events.append)  # the index learns what the host tier holds
            self.store_fetcher = StoreFetcher(tiers, self.loop.call, self.telemetry.metrics)
            self.telemetry.metrics.registry.register(KVTierCollector(worker_id, "prefill", tiers))
        freeze_startup_heap()  # this actor's process is ours: later full collections skip the startup heap

    async def ready(self) -> WorkerInfo:
        cfg = self.engine.model_config
        return WorkerInfo(
            self.worker_id,
            "prefill",
            (self.peer_id,),
            self.engine.num_blocks,
            self.engine.config.block_size,
            cfg.num_kv_heads,
            spec_fingerprint(),
            cfg.identity,
            self.engine.max_model_len,
            cfg.vocab_size,
            cfg.eos_token_ids,
            self.engine.runner.kv_cache.bytes_per_token,
            self.epoch,
        )

    async def ping(self) -> Liveness:
        error = self.loop.error
        return Liveness(self.worker_id, self.epoch, self.loop.running, None if error is None else repr(error))

    async def set_membership(self, membership: Membership) -> None:
        """The controller's latest membership: peers to pull from; channels to departed peers close."""
        if membership.version <= self.membership.version and membership.cluster_id == self.membership.cluster_id:
            return
        gone = self.membership.peer_ids() - membership.peer_ids()
        self.membership = membership
        for peer in gone:
            self.transport.forget_peer(peer)
            self.puller.transport.forget_peer(pull_peer_id(peer))

    async def prefill(self, request: GenerateRequest, decode: Member | None, owner: str):
        """Streaming: yields the request's queue changes (PrefillQueue, see first_token.py), the first
        token (PrefillResult), then — when the sequence continues on `decode` — the hand-off's
        HandoffStats. Raises InvalidRequestError for bad input, HandoffFailed when the KV could not
        reach `decode`. `owner` is the caller's id on the decode instance. A hand-off stopped by
        `abort()` ends the stream without an item: the caller aborted it and reads no more."""
        rid = request.request_id
        self._sessions[rid] = None
        waiter = None
        trace = PrefillTrace.start(request, self.worker_id)
        try:
            if request.prefix_pull is not None:  # pulling is waiting, not computing: a death now is not its doing
                yield self.first_tokens.waiting_for_pull(rid)
            waiter = await self._enqueue(request, trace)
            async for change in self.first_tokens.queue_changes(rid, waiter):
                yield change  # PrefillQueue: waiting in this worker's queue, or being computed now
            result, handoff = await waiter
            trace.computed(result, self.first_tokens.chunks.pop(rid, []))
            yield result
            if handoff is None:
                return
            if decode is None:  # prefill-only use (benchmarks): nothing to send
                self.loop.call(lambda engine: engine.release(rid))
                return
            stats = await self._hand_off(trace.handing_off(request, decode.worker_id), result, handoff, decode, owner)
            trace.handed_off(stats)
            if stats is not None:
                yield stats
        except BaseException as err:
            trace.failed(err)
            raise
        finally:
            trace.end()
            self._sessions.pop(rid, None)
            self.first_tokens.drop_markers(rid)  # a stream closed before it read them leaves them
            if waiter is None:  # left before its request reached the engine: nothing else forgets it
                self.first_tokens.forget(rid)

    async def _enqueue(self, request: GenerateRequest, trace: PrefillTrace) -> asyncio.Future:
        """Adds the request to the engine (after its prefix pull, if any); the future of its first
        token: (PrefillResult, the hand-off's pinned blocks or None)."""
        rid = request.request_id
        waiter = self.first_tokens.expect(rid)
        try:
            if request.prefix_pull is not None:
                with trace.pulling(request.prefix_pull):
                    self.first_tokens.pulls[rid] = await self.puller.pull(request)
                if not self.first_tokens.is_waiting(rid):  # aborted while pulling: the waiter already failed
                    self.loop.call(lambda engine: engine.release(pull_table_id(rid)))
                    return waiter
            elif self.store_fetcher is not None:
                await self.store_fetcher.fetch(request)
                if not self.first_tokens.is_waiting(rid):  # aborted while fetching
                    self.loop.call(lambda engine: engine.release(pull_table_id(rid)))
                    return waiter
            trace.enqueued()
            await asyncio.wrap_future(
                self.loop.call(
                    lambda engine: engine.add_request(
                        rid,
                        request.prompt_token_ids,
                        request.params,
                        priority=request.priority,
                        tenant_salt=request.tenant,
                        output_token_ids=request.output_token_ids,
                    )
                )
            )
        except Exception:
            self.first_tokens.forget(rid)
            self.loop.call(lambda engine: engine.release(pull_table_id(rid)))
            raise
        return waiter

    async def _hand_off(
        self, request: GenerateRequest, result: PrefillResult, handoff: Handoff, decode: Member, owner: str
    ) -> HandoffStats | None:
        """The hand-off's stats; None when `abort()` stopped it."""
        rid = request.request_id
        deadline_s = request.deadline_s or time.time() + self.request_timeout_s
        session = HandoffSession(
            rid,
            handoff.num_computed_tokens,
            RayDecodeEndpoint(decode, request, result.token_id, owner, self.peer_id),
            lambda target: self._send_kv(handoff, target),
            lambda: self.loop.call(lambda engine: engine.release(rid)),
            self.kv_sender,
            deadline_s,
            kv_layout=(f"prefill worker {self.worker_id!r}", self.engine.runner.kv_cache.layout),
        )
        if rid not in self._sessions:  # aborted between the first token and now
            session.cancel()
        self._sessions[rid] = session
        try:
            stats = await session.run()
        except HandoffFailed:
            self.telemetry.metrics.handoff_finished("aborted" if session.cancelled else "failed")
            if session.cancelled:  # nobody reads the stream any more: an exception would only be logged
                return None
            raise
        self.telemetry.metrics.handoff_finished("ok")
        self.telemetry.metrics.observe_transfer("send", stats.num_bytes, stats.elapsed_s)
        return stats

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
        """Holder side of a prefix pull (prefill_worker/prefix_pull.py): pins the prefix blocks it still
        holds and sends blocks [start_block, ...) to the requester; returns how many it will send."""
        return await self.exporter.export(
            requester_id, requester_peer, request_id, token_ids, tenant, start_block, num_blocks
        )

    async def receive_prefix(self, holder_peer: str, request_id: str) -> None:
        """Announced by a holder right before it sends a prefix this worker asked for."""
        await asyncio.get_running_loop().run_in_executor(
            self.puller.receive_pool, self.puller.receiver.receive, holder_peer, request_id
        )

    async def abort(self, request_id: str) -> bool:
        def abort(engine: LLMEngine) -> bool:
            engine.release(pull_table_id(request_id))
            return engine.abort_request(request_id)

        aborted = await asyncio.wrap_future(self.loop.call(abort))
        session = self._sessions.pop(request_id, None)
        if session is not None:  # its hand-off stops at the next step, releasing what it holds
            session.cancel()
        self.first_tokens.abort(request_id)
        return aborted

    async def read_kv_events(self, since_seq: int, max_wait_s: float = 0.0) -> KVEventBatch:
        """The prefix-cache events after `since_seq` of this worker's current epoch (see KVEventBatch);
        with `max_wait_s`, a reader that has them all waits up to that long for the next (a long poll)."""
        if max_wait_s > 0:
            await self.kv_events.wait_past(since_seq, max_wait_s)
        return self.kv_events.read_since(since_seq)

    async def check_integrity(self) -> dict:
        """Runs the block pool's integrity check; reports blocks and sequences still held."""

        def check(engine: LLMEngine) -> dict:
            engine.kv.check_integrity()
            return {
                "num_blocks": engine.num_blocks,
                "num_free_blocks": engine.kv.num_free_blocks,
                "num_sequences": len(engine.seqs),
                "num_grammar_matchers": len(engine.structured.matchers),
            }

        return await asyncio.wrap_future(self.loop.call(check))

    async def stats(self) -> WorkerStats:
        """Load and recent engine steps (see WorkerTelemetry), hand-offs in flight."""
        in_flight = sum(session is not None for session in self._sessions.values())
        stats = self.telemetry.stats(self.loop, in_flight)
        if self.store_fetcher is None:
            return stats
        tiers = self.store_fetcher.tiers
        return dataclasses.replace(stats, kv_tiers=tiers.status(), store_reads=tiers.reads())

    async def debug_signal(self, signum: int) -> None:
        """Fault injection (chaos, tests): send `signum` to this actor's own process (SIGKILL: no cleanup)."""
        os.kill(os.getpid(), signum)

    async def debug_set_step_delay(self, seconds: float) -> None:
        """Fault injection for tests: sleep `seconds` before each engine step."""
        self.loop.step_delay_s = seconds

    async def kv_tier_stats(self) -> dict[str, dict[str, int]]:
        """Per KV tier (host, redis) and for the worker: blocks stored, fetched, refused; hits, bytes."""
        return {} if self.store_fetcher is None else self.store_fetcher.tiers.stats()

    def shutdown(self) -> None:
        if self.index_publisher is not None:
            self.index_publisher.stop()
        if self.store_fetcher is not None:
            self.store_fetcher.close()
        self.telemetry.close()
        self.loop.stop()
        self._sender.shutdown(wait=False, cancel_futures=True)
        self.puller.close()
        self.transport.close()

    def _on_kv_event(self, event: KVCacheEvent) -> None:
        """Engine thread: the index learns of the block; the KV tiers get a copy of a newly cached one."""
        self.kv_events.append(event)
        if self.store_fetcher is not None:
            self.store_fetcher.tiers.on_kv_event(event)

    # ---- sender thread ----------------------------------------------------------------------------
    def _send_kv(self, handoff: Handoff, target: HandoffTarget) -> int:
        return send_sequence_kv(
            self.transport,
            self.engine.runner.kv_cache,
            handoff.block_ids,
            handoff.num_computed_tokens,
            handoff.seq_id,
            target,
        )

    def _find_prefill(self, worker_id: str) -> PrefillHandle | None:
        member = self.membership.get(worker_id)
        return member.prefill_worker if member is not None and member.role == "prefill" else None


def _start_publisher(buffer: KVEventBuffer, config: ClusterConfig, engine: LLMEngine):
    """With a Redis index configured, this worker publishes its KV events there (several routers read
    them); without one, routers pull them with `read_kv_events`."""
    if config.redis_url is None:
        return None
    from prefix_index import IndexNamespace, RedisIndexPublisher

    namespace = IndexNamespace(engine.model_config.identity, engine.config.block_size)
    return RedisIndexPublisher(buffer, config.redis_url, namespace, config.index_lease_s).start()


if TYPE_CHECKING:  # mypy holds the actor to its remote interface
    _implements: type[PrefillWorkerApi] = PrefillWorker
