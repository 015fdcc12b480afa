"""The prefill worker: a Ray actor that computes prompts and hands their KV blocks to decode.

It owns an engine in the prefill role (batched chunked prefill under a token budget, local prefix
reuse). `prefill()` queues a request and returns its first token as soon as it is sampled; the KV
then moves to the decode ranks named in the request's `HandoffTarget` on a sender thread, while the
engine goes on computing other prompts. `wait_handoff()` reports how that transfer ended. The
sequence's blocks stay pinned until every decode rank acked or the lease ended, then are released
(they stay in the prefix cache).
"""
from __future__ import annotations

import asyncio
import time

import ray
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from cluster.config import ClusterConfig
from cluster.kv_events import KVEventBatch, KVEventBuffer
from cluster.worker_telemetry import WorkerTelemetry
from cluster.messages import GenerateRequest, HandoffStats, PrefillResult, WorkerInfo
from engine.block_hash import spec_fingerprint
from engine.engine_loop import EngineLoop
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, SequenceUpdate
from engine.sequence import FinishReason
from kvtransfer.handoff import HandoffTarget, remaining_s, send_sequence_kv
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.transport import TransferError


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

    async def ready(self) -> WorkerInfo:
        cfg = self.engine.model_config
        return WorkerInfo(self.worker_id, "prefill", (self.worker_id,), self.engine.num_blocks,
                          self.engine.config.block_size, cfg.num_kv_heads, spec_fingerprint(), cfg.identity,
                          self.engine.max_model_len, cfg.vocab_size, cfg.eos_token_ids)

    async def prefill(self, request: GenerateRequest, target: HandoffTarget | None) -> PrefillResult:
        """Computes the prompt and returns the first token; raises InvalidRequestError for bad input."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters[request.request_id] = (loop, waiter, target)
        self._started_s[request.request_id] = time.perf_counter()
        try:
            await asyncio.wrap_future(self.loop.call(lambda engine: engine.add_request(
                request.request_id, request.prompt_token_ids, request.params, priority=request.priority,
                tenant_salt=request.tenant)))
        except Exception:
            self._waiters.pop(request.request_id, None)
            self._started_s.pop(request.request_id, None)
            raise
        return await waiter

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
        aborted = await asyncio.wrap_future(self.loop.call(lambda engine: engine.abort_request(request_id)))
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
        self.transport.close()

    # ---- engine thread ----------------------------------------------------------------------------
    def _on_updates(self, updates: list[SequenceUpdate]) -> None:
        for update in updates:
            if update.finish_reason is None:
                continue
            seq = self.engine.pop_finished(update.seq_id)
            entry = self._waiters.pop(update.seq_id, None)
            started_s = self._started_s.pop(update.seq_id, time.perf_counter())
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
                                   seq.num_cached_tokens, time.perf_counter() - started_s)
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
            # Each decode rank posts its receive only when told the data is coming: no rank ever waits
            # on an idle channel, so a timeout always means a real failure.
            announced = [ray.get_actor(rank.peer_id).receive_kv.remote(self.worker_id, handoff.seq_id)
                         for rank in target.ranks]
            num_bytes = send_sequence_kv(self.transport, self.engine.runner.kv_cache, handoff.block_ids,
                                         handoff.num_computed_tokens, handoff.seq_id, target)
            for confirmation in [ref.future() for ref in announced]:
                confirmation.result(timeout=remaining_s(target.lease_deadline_s))
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
