"""Callers waiting for a prompt's first token, and the engine-thread callbacks that answer them.

`PrefillWorker.prefill` awaits on the actor's event loop while the prompt runs on the engine thread.
Each request waiting for its first token holds a future here (`expect`); `on_updates`, the engine
loop's update callback, resolves it with the `PrefillResult` and, for a sequence handed off to
decode, its pinned blocks, or fails it when the prompt can never fit the pool; `abort` fails it with
`RequestAborted`. A request's prefix-pull outcome (`pulls`) waits here to be reported with its first
token.

Before the first token, a caller learns when its request waits in the queue and when it then starts
(`queue_changes`, `PrefillQueue` markers): before its prefix pull (`waiting_for_pull`), after a step
that did not schedule it (`on_updates`), and from the engine's `on_scheduled` hook before the step
that does runs, so a request that kills the worker while being computed has said so first. A request
without a pull that the first step schedules gets no marker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq

from common import tracing
from common.messages import PrefillQueue, PrefillResult, PullOutcome
from common.worker_metrics import WorkerMetrics
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.scheduler import ScheduledChunk
from engine.sequence import FinishReason
from engine.step_updates import SequenceUpdate
from prefill_worker.prefix_pull import pull_table_id


class RequestAborted(RuntimeError):
    """The request was aborted before its first token."""


class FirstTokenWaiters:
    """The first-token futures of one prefill worker's requests (`engine`'s sequences)."""

    def __init__(self, engine: LLMEngine, metrics: WorkerMetrics):
        self.engine, self.metrics = engine, metrics
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._started_s: dict[str, float] = {}
        self.pulls: dict[str, PullOutcome] = {}  # request id → its prefix pull, until its first token
        self._markers: dict[str, asyncio.Queue] = {}  # request id → its PrefillQueue markers (caller's loop)
        self._scheduled: set[str] = set()  # awaited requests a step has scheduled (engine thread)
        self._told_waiting: set[str] = set()  # awaited requests told they wait and not yet that they run
        # tracing on: request id → (time.time_ns(), tokens) of each prefill chunk scheduled (engine thread)
        self.chunks: dict[str, list[tuple[int, int]]] = {}
        engine.on_scheduled = self.on_scheduled

    def expect(self, request_id: str) -> asyncio.Future:
        """A future, on the running loop, of the request's (PrefillResult, hand-off blocks or None)."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._markers[request_id] = asyncio.Queue()
        self._waiters[request_id] = (loop, waiter)
        self._started_s[request_id] = time.perf_counter()
        return waiter

    async def queue_changes(self, request_id: str, waiter: asyncio.Future) -> AsyncIterator[PrefillQueue]:
        """The request's queue markers, in order, until `waiter` (its `expect` future) is done; then
        the markers are forgotten. Its queue outlives the first token (the engine thread's `_answer`
        leaves it): a step may answer the request before the caller starts reading."""
        markers = self._markers.get(request_id)
        try:
            while markers is not None and not waiter.done():
                get = asyncio.ensure_future(markers.get())
                try:
                    await asyncio.wait({get, waiter}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    get.cancel()
                if get.done() and not get.cancelled():
                    yield get.result()
            # Markers queued before the waiter was answered (both arrive in order on this loop), e.g. when
            # the first token came first: the "being computed" one still precedes it.
            while markers is not None and not markers.empty():
                yield markers.get_nowait()
        finally:
            self.drop_markers(request_id)

    def drop_markers(self, request_id: str) -> None:
        """Forgets the request's marker queue (the caller is done reading; idempotent)."""
        self._markers.pop(request_id, None)

    def waiting_for_pull(self, request_id: str) -> PrefillQueue:
        """The marker for a request about to pull its prefix (it waits, it is not computed); the step
        that later starts it says so, as for a request told it waits in the queue."""
        self._told_waiting.add(request_id)
        return PrefillQueue(request_id, waiting=True)

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiters

    def forget(self, request_id: str) -> None:
        self.chunks.pop(request_id, None)
        self._waiters.pop(request_id, None)
        self._started_s.pop(request_id, None)
        self.pulls.pop(request_id, None)
        self._forget_queue(request_id)
        self.drop_markers(request_id)

    def _forget_queue(self, request_id: str) -> None:
        self._scheduled.discard(request_id)
        self._told_waiting.discard(request_id)

    def abort(self, request_id: str) -> None:
        self._forget_queue(request_id)
        entry = self._waiters.pop(request_id, None)
        if entry is not None:  # a caller still waits for the first token: tell it, don't leave it hanging
            loop, waiter = entry
            loop.call_soon_threadsafe(_fail, waiter, RequestAborted(f"{request_id!r} was aborted"))

    # ---- engine thread ----------------------------------------------------------------------------
    def on_scheduled(self, chunks: Seq[ScheduledChunk]) -> None:
        """Before a step runs: awaited requests it schedules for the first time; those told they wait
        learn that they are being computed."""
        traced = tracing.enabled()
        for chunk in chunks:
            rid = chunk.seq.seq_id
            if traced and rid in self._waiters:
                self.chunks.setdefault(rid, []).append((time.time_ns(), chunk.num_new_tokens))
            if rid in self._waiters and rid not in self._scheduled:
                self._scheduled.add(rid)
                started_s = self._started_s.get(rid)
                if started_s is not None:
                    self.metrics.observe_queue_time(time.perf_counter() - started_s)
                if rid in self._told_waiting:
                    self._told_waiting.discard(rid)
                    self._tell(rid, waiting=False)

    def _tell_waiting(self) -> None:
        """After a step: awaited requests in the engine that no step has scheduled yet are told they wait."""
        for rid in list(self._waiters):  # a snapshot: the caller's loop adds and removes entries meanwhile
            if rid not in self._scheduled and rid not in self._told_waiting and rid in self.engine.seqs:
                self._told_waiting.add(rid)
                self._tell(rid, waiting=True)

    def _tell(self, request_id: str, waiting: bool) -> None:
        entry, markers = self._waiters.get(request_id), self._markers.get(request_id)
        if entry is not None and markers is not None:
            entry[0].call_soon_threadsafe(markers.put_nowait, PrefillQueue(request_id, waiting))

    def on_updates(self, updates: list[SequenceUpdate]) -> None:
        self._answer(updates)
        self._tell_waiting()

    def _answer(self, updates: list[SequenceUpdate]) -> None:
        for update in updates:
            if update.finish_reason is None:
                continue
            seq = self.engine.pop_finished(update.seq_id)
            self.engine.release(pull_table_id(update.seq_id))  # the prefix served its purpose
            self._forget_queue(update.seq_id)
            entry = self._waiters.pop(update.seq_id, None)
            started_s = self._started_s.pop(update.seq_id, time.perf_counter())
            pull = self.pulls.pop(update.seq_id, None)
            if entry is None:
                self.engine.release(update.seq_id)  # nobody waits (aborted): drop its pins
                continue
            loop, waiter = entry
            if not update.new_token_ids:  # ended unscheduled: the prompt can never fit this pool
                loop.call_soon_threadsafe(
                    _fail,
                    waiter,
                    InvalidRequestError(
                        "prompt", f"needs more KV blocks than this worker's pool of {self.engine.num_blocks}"
                    ),
                )
                continue
            # The prefilled context: the prompt plus, for a migrated request, the tokens it already streamed
            # (its cache hits can reach past the prompt into those).
            self.metrics.observe_prompt(seq.num_tokens - len(update.new_token_ids), seq.num_cached_tokens)
            handoff = update.finish_reason is FinishReason.HANDOFF
            result = PrefillResult(
                update.seq_id,
                update.new_token_ids[0],
                seq.logprobs[0] if seq.logprobs else None,
                None if handoff else update.finish_reason.value,
                handoff,
                seq.num_cached_tokens,
                time.perf_counter() - started_s,
                pull,
                _prompt_logprobs(seq),
                update.text_end_chars,
            )
            blocks = self.engine.handoff_blocks(update.seq_id) if handoff else None  # pinned until released
            loop.call_soon_threadsafe(_resolve, waiter, (result, blocks))


def _prompt_logprobs(seq) -> tuple | None:
    """The prompt's logprobs after its first token, when asked and computed here (a resumed request's
    first attempt returned them)."""
    if seq.params.prompt_logprobs is None or len(seq.prompt_logprobs) != seq.num_prompt_tokens:
        return None
    return tuple(seq.prompt_logprobs[1:])


def _fail(waiter: asyncio.Future, error: BaseException) -> None:
    if not waiter.done():
        waiter.set_exception(error)


def _resolve(waiter: asyncio.Future, result) -> None:
    if not waiter.done():
        waiter.set_result(result)
