"""The prefill worker: a Ray actor that computes prompts and hands their KV blocks to decode.

It owns an engine in the prefill role (batched chunked prefill under a token budget, local prefix
reuse). `prefill()` queues a request and returns its first token as soon as it is sampled; the KV
then moves to the decode ranks named in the request's `HandoffTarget` on a sender thread, while the
engine goes on computing other prompts. `wait_handoff()` reports how that transfer ended. The
sequence's blocks stay pinned until every decode rank acked or the lease ended, then are released
(they stay in the prefix cache). A request may first pull its prefix from a peer prefill worker
that holds it (`export_prefix` / `receive_prefix`; see prefill_worker/prefix_pull.py).
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from cluster.config import ClusterConfig
from cluster.kv_events import KVEventBatch, KVEventBuffer
from cluster.worker_telemetry import WorkerTelemetry
from cluster.messages import GenerateRequest, HandoffStats, PrefillResult, PullOutcome, WorkerInfo
from engine.block_hash import spec_fingerprint
from engine.engine_loop import EngineLoop
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, SequenceUpdate
from engine.sequence import FinishReason
from kvtransfer.handoff import HandoffTarget, RankTarget, call_timeout_s, remaining_s, send_sequence_kv
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.transport import TransferError
from prefill_worker.prefix_pull import PrefixPuller, export_table_id, pin_export, pull_peer_id, pull_table_id

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, worker_id: str, config: dict, model_dir: str, store_host: str, store_port: int):
        cluster_config = ClusterConfig.from_dict(config)
        self.worker_id = worker_id
        self.lease_s = cluster_config.handoff_lease_s
        self.kv_events = KVEventBuffer(worker_id)  # read by prefix indexers, off the engine thread
        self.engine = LLMEngine(cluster_config.engine_config("prefill", model_dir), on_kv_event=self.kv_events.append)
        self.index_publisher = _start_publisher(self.kv_events, cluster_config, self.engine)
        self.telemetry = WorkerTelemetry(worker_id, "prefill", cluster_config)
        self.transport = TorchDistTransport(worker_id, store_host, store_port)
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, HandoffTarget | None]] = {}
        self._handoffs: dict[str, Future] = {}
        self._started_s: dict[str, float] = {}
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-sender")
        self.loop = EngineLoop(self.engine, self._on_updates, name=f"{worker_id}-engine",
                               on_step=self.telemetry.on_step).start()
        self.puller = PrefixPuller(worker_id, store_host, store_port, self.engine, self.loop.call,
                                   cluster_config.prefix_pull_timeout_s, self.telemetry.metrics)
        self._pulls: dict[str, PullOutcome] = {}  # request id → its prefix pull, until its first token

    async def ready(self) -> WorkerInfo:
        cfg = self.engine.model_config
        kv = self.engine.runner.kv_cache  # [layers, 2, kv_heads, blocks, block_size, head_dim]
        return WorkerInfo(self.worker_id, "prefill", (self.worker_id,), self.engine.num_blocks,
                          self.engine.config.block_size, cfg.num_kv_heads, spec_fingerprint(), cfg.identity,
                          self.engine.max_model_len, cfg.vocab_size, cfg.eos_token_ids,
                          kv[:, :, :, 0, 0].numel() * kv.element_size())

    async def prefill(self, request: GenerateRequest, target: HandoffTarget | None) -> PrefillResult:
        """Computes the prompt (after pulling its prefix from a peer, if asked) and returns the first
        token; raises InvalidRequestError for bad input."""
        loop, rid = asyncio.get_running_loop(), request.request_id
        waiter = loop.create_future()
        self._waiters[rid] = (loop, waiter, target)
        self._started_s[rid] = time.perf_counter()
        try:
            if request.prefix_pull is not None:
                self._pulls[rid] = await self.puller.pull(request)
                if rid not in self._waiters:  # aborted while pulling: the waiter already failed
                    self.loop.call(lambda engine: engine.release(pull_table_id(rid)))
                    return await waiter
            await asyncio.wrap_future(self.loop.call(lambda engine: engine.add_request(
                rid, request.prompt_token_ids, request.params, priority=request.priority,
                tenant_salt=request.tenant)))
        except Exception:
            self._waiters.pop(rid, None)
            self._started_s.pop(rid, None)
            self._pulls.pop(rid, None)
            self.loop.call(lambda engine: engine.release(pull_table_id(rid)))
            raise
        return await waiter

    async def export_prefix(self, requester_id: str, request_id: str, token_ids: tuple[int, ...], tenant: str,
                            start_block: int, num_blocks: int) -> int:
        """Holder side of a prefix pull (prefill_worker/prefix_pull.py): pins the prefix blocks it still
        holds and sends blocks [start_block, ...) to `requester_id`; returns how many it will send."""
        table = export_table_id(requester_id, request_id)
        block_ids = await asyncio.wrap_future(self.loop.call(
            lambda engine: pin_export(engine, table, token_ids, tenant, num_blocks)))
        if len(block_ids) <= start_block:
            self.loop.call(lambda engine: engine.release(table))
            return 0
        deadline_s = time.time() + self.puller.timeout_s
        self._sender.submit(self._serve_pull, table, block_ids[start_block:], requester_id, request_id, deadline_s)
        return len(block_ids) - start_block

    async def receive_prefix(self, holder_id: str, request_id: str) -> None:
        """Announced by a holder right before it sends a prefix this worker asked for."""
        await asyncio.get_running_loop().run_in_executor(self.puller.receive_pool, self.puller.receiver.receive,
                                                         holder_id, request_id)

    async def wait_handoff(self, request_id: str) -> HandoffStats:
        """Waits for the KV transfer of a handed-off request; raises TransferError if it failed."""
        future = self._handoffs.get(request_id)
        if future is None:
            raise KeyError(f"no hand-off in progress for {request_id!r}")
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.lease_s + 5.0)
        finally:
            self._handoffs.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        def abort(engine: LLMEngine) -> bool:
            engine.release(pull_table_id(request_id))
            return engine.abort_request(request_id)

        aborted = await asyncio.wrap_future(self.loop.call(abort))
        self._handoffs.pop(request_id, None)  # nobody will wait for it; its sender still releases the pins
        entry = self._waiters.pop(request_id, None)
        if entry is not None:  # a caller still waits for the first token: tell it, don't leave it hanging
            loop, waiter, _ = entry
            loop.call_soon_threadsafe(_fail, waiter, RequestAborted(f"{request_id!r} was aborted"))
        return aborted

    async def read_kv_events(self, since_seq: int) -> KVEventBatch:
        """The prefix-cache events after `since_seq` of this worker's current epoch (see KVEventBatch)."""
        return self.kv_events.read_since(since_seq)

    async def check_integrity(self) -> dict:
        """Runs the block pool's integrity check; reports blocks and sequences still held."""
        def check(engine: LLMEngine) -> dict:
            engine.kv.check_integrity()
            return {"num_blocks": engine.num_blocks, "num_free_blocks": engine.kv.num_free_blocks,
                    "num_sequences": len(engine.seqs)}
        return await asyncio.wrap_future(self.loop.call(check))

    async def stats(self) -> dict:
        """Load, recent engine steps and this worker's metrics (see WorkerTelemetry)."""
        stats = await asyncio.wrap_future(self.loop.call(
            lambda engine: self.telemetry.engine_stats(engine, self.loop.step_log)))
        return {**stats, "handoffs_in_flight": len(self._handoffs)}

    async def debug_set_step_delay(self, seconds: float) -> None:
        """Fault injection for tests: sleep `seconds` before each engine step."""
        self.loop.step_delay_s = seconds

    def shutdown(self) -> None:
        if self.index_publisher is not None:
            self.index_publisher.stop()
        self.telemetry.close()
        self.loop.stop()
        self._sender.shutdown(wait=False, cancel_futures=True)
        self.puller.close()
        self.transport.close()

    # ---- engine thread ----------------------------------------------------------------------------
    def _on_updates(self, updates: list[SequenceUpdate]) -> None:
        for update in updates:
            if update.finish_reason is None:
                continue
            seq = self.engine.pop_finished(update.seq_id)
            self.engine.release(pull_table_id(update.seq_id))  # the prefix served its purpose
            entry = self._waiters.pop(update.seq_id, None)
            started_s = self._started_s.pop(update.seq_id, time.perf_counter())
            pull = self._pulls.pop(update.seq_id, None)
            if entry is None:
                self.engine.release(update.seq_id)  # nobody waits (aborted): drop its pins
                continue
            loop, waiter, target = entry
            if not update.new_token_ids:  # ended unscheduled: the prompt can never fit this pool
                loop.call_soon_threadsafe(_fail, waiter, InvalidRequestError(
                    "prompt", f"needs more KV blocks than this worker's pool of {self.engine.num_blocks}"))
                continue
            self.telemetry.metrics.observe_prompt(seq.num_prompt_tokens, seq.num_cached_tokens)
            handoff = update.finish_reason is FinishReason.HANDOFF
            if handoff:
                self._start_handoff(update.seq_id, target)
            result = PrefillResult(update.seq_id, update.new_token_ids[0],
                                   seq.logprobs[0] if seq.logprobs else None,
                                   None if handoff else update.finish_reason.value, handoff,
                                   seq.num_cached_tokens, time.perf_counter() - started_s, pull)
            loop.call_soon_threadsafe(_resolve, waiter, result)

    def _start_handoff(self, seq_id: str, target: HandoffTarget | None) -> None:
        handoff = self.engine.handoff_blocks(seq_id)
        if target is None:  # prefill-only use (benchmarks): nothing to send
            self.engine.release(seq_id)
            return
        self._handoffs[seq_id] = self._sender.submit(self._send, handoff, target)

    def _send(self, handoff, target: HandoffTarget) -> HandoffStats:
        started_s = time.perf_counter()
        try:
            remaining_s(target.lease_deadline_s)  # once announced, a hand-off is carried through (handoff.py)
            # Each decode rank posts its receive only when told the data is coming: no rank ever waits
            # on an idle channel, so a timeout always means a real failure.
            announced = [ray.get_actor(rank.peer_id).receive_kv.remote(self.worker_id, handoff.seq_id)
                         for rank in target.ranks]
            num_bytes = send_sequence_kv(self.transport, self.engine.runner.kv_cache, handoff.block_ids,
                                         handoff.num_computed_tokens, handoff.seq_id, target)
            for confirmation in [ref.future() for ref in announced]:
                confirmation.result(timeout=call_timeout_s(target.lease_deadline_s))
            elapsed_s = time.perf_counter() - started_s
            self.telemetry.metrics.observe_transfer("send", num_bytes, elapsed_s)
            self.telemetry.metrics.handoff_finished(True)
            return HandoffStats(num_bytes, elapsed_s)
        except TransferError:
            self.telemetry.metrics.handoff_finished(False)
            raise
        except FutureTimeout:
            self.telemetry.metrics.handoff_finished(False)
            raise TransferError(target.instance_id, "decode ranks did not confirm within the lease") from None
        except Exception as err:  # anything else still ends this hand-off, named
            self.telemetry.metrics.handoff_finished(False)
            raise TransferError(target.instance_id, f"{type(err).__name__}: {err}") from err
        finally:
            self.loop.call(lambda engine: engine.release(handoff.seq_id))


    def _serve_pull(self, table: str, block_ids: tuple[int, ...], requester_id: str, request_id: str,
                    deadline_s: float) -> None:
        """Sender thread: the holder's part of a prefix pull (pins released whatever happens)."""
        started_s = time.perf_counter()
        try:
            remaining_s(deadline_s)  # past it the requester gave up: announce nothing
            announced = ray.get_actor(requester_id).receive_prefix.remote(self.worker_id, request_id)
            peer, kv_cache = pull_peer_id(requester_id), self.engine.runner.kv_cache
            target = HandoffTarget(peer, (RankTarget(peer, 0, kv_cache.shape[2]),), (), deadline_s)
            num_bytes = send_sequence_kv(self.transport, kv_cache, block_ids,
                                         len(block_ids) * self.engine.config.block_size, request_id, target)
            announced.future().result(timeout=call_timeout_s(deadline_s))
            self.telemetry.metrics.observe_transfer("pull_out", num_bytes, time.perf_counter() - started_s)
        except Exception as err:  # the requester falls back to recomputing; nothing else to do here
            log.info("prefix pull %r for %s failed: %s: %s", request_id, requester_id, type(err).__name__, err)
        finally:
            self.loop.call(lambda engine: engine.release(table))


def _start_publisher(buffer: KVEventBuffer, config: ClusterConfig, engine: LLMEngine):
    """With a Redis index configured, this worker publishes its KV events there (several routers read
    them); without one, the router pulls them with `read_kv_events`."""
    if config.redis_url is None:
        return None
    from cluster.prefix_index import IndexNamespace, RedisIndexPublisher

    namespace = IndexNamespace(engine.model_config.identity, engine.config.block_size)
    return RedisIndexPublisher(buffer, config.redis_url, namespace, config.index_lease_s).start()


class RequestAborted(RuntimeError):
    """The request was aborted before its first token."""


def _fail(waiter: asyncio.Future, error: BaseException) -> None:
    if not waiter.done():
        waiter.set_exception(error)


def _resolve(waiter: asyncio.Future, result) -> None:
    if not waiter.done():
        waiter.set_result(result)
