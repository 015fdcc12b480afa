"""The cluster's request API: submit a request, iterate its tokens (what the router builds on).

It carries steps 1 and 3-5 of one attempt (docs/architecture.md, "Request lifecycle"), every wait bounded by the
request's deadline: one streaming call to the chosen prefill worker (`PrefillWorkerApi.prefill`: queue
changes, the first token, the hand-off's figures), then the decode instance's per-step outputs, which
one poller per instance fans out to the requests' queues. Failures end the stream with `RequestFailed`
stating the facts (phase, lost worker); whether the request then migrates is the router's decision
(router/migration.py). Leaving early (cancel, deadline, error) aborts the request on both workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import secrets
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from enum import StrEnum

from ray.exceptions import RayActorError, RayTaskError

from common.actor_api import PrefillEvent
from common.membership import Member
from common.messages import GenerateRequest, PrefillQueue, PrefillResult, PullOutcome, TokenUpdate
from engine.errors import InvalidRequestError
from kvtransfer.session import HandoffFailed, HandoffStats

POLL_WAIT_S = 0.2


class AttemptPhase(StrEnum):
    """Where an attempt stood when it failed: waiting in the prefill worker's queue (or for its prefix
    pull), being prefilled, in its KV hand-off, or decoding. The router's migration rules read it."""

    QUEUED = "queued"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    DECODE = "decode"


class RequestFailed(RuntimeError):
    """A request could not complete. `unavailable` marks worker loss (retry-safe before the first
    token); `timed_out` its deadline passing; otherwise the request itself was refused (`field` names
    the bad input, if any). The facts a migration is decided on (router/migration.py): `phase`,
    `lost_worker`, `decode_lost`."""

    def __init__(
        self,
        reason: str,
        *,
        unavailable: bool = False,
        field: str | None = None,
        timed_out: bool = False,
        out_of_capacity: bool = False,
        lost_worker: tuple[str, int] | None = None,
        decode_lost: bool = False,
        phase: AttemptPhase = AttemptPhase.PREFILL,
    ):
        super().__init__(reason)
        self.reason, self.unavailable, self.field, self.timed_out = reason, unavailable, field, timed_out
        self.out_of_capacity = out_of_capacity  # a worker's KV pool is full now: retry later
        self.lost_worker = lost_worker  # (worker id, epoch) of a worker found dead on the way, if any
        self.decode_lost = decode_lost  # its hand-off found the decode instance dead or silent
        self.phase = phase  # where the attempt failed (the client corrects it on the way out: see AttemptPhase)


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    logprobs: tuple
    finish_reason: str | None
    num_cached_tokens: int = 0  # first chunk: prompt tokens the prefill worker had cached (pulled included)
    pull: PullOutcome | None = None  # first chunk: the prefix pull the request asked for, if any
    prompt_logprobs: tuple | None = None  # first chunk: TokenLogprobs of prompt tokens 1.., when asked
    text_end_chars: int | None = None  # last chunk, when a stop string ended it: where the output text ends


class ClusterClient:
    """`cluster` is anything with the current `prefill` / `decode` members and the `config` (a
    LaunchedCluster snapshot, or a router's live ClusterView)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self._prefill_turn = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}
        self._load: Counter = Counter()  # decode worker id → requests in flight from this client
        self._pollers: dict[tuple[str, int], asyncio.Task] = {}  # (decode worker id, epoch) → its poller
        self._instance_of: dict[str, tuple[str, int]] = {}  # request id → (decode worker id, epoch)
        self.client_id = secrets.token_hex(4)  # decode instances route this client's tokens by it
        self._cleanups: dict[str, asyncio.Task] = {}  # request id → abort in progress on its workers
        self.handoff_listeners: list = []  # called with each finished hand-off's HandoffStats (cost models)
        # called with a decode worker's id after this client's count of requests on it changed (a
        # router keeps its decode choice in load order with it instead of scanning the pool per request)
        self.decode_load_listeners: list = []

    @property
    def num_cleanups(self) -> int:
        return len(self._cleanups)

    def decode_load(self, worker_id: str) -> int:
        """Requests this client has in flight on a decode instance."""
        return self._load[worker_id]

    async def generate(
        self,
        request: GenerateRequest,
        prefill: Member | None = None,
        decode: Member | None = None,
        deadline_s: float | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Streams the request's tokens. `deadline_s` (time.monotonic) bounds it, and so does the
        config's request_timeout_s. Leaving early (cancel, deadline, error) aborts it on both workers."""
        prefill = prefill or self._next_prefill()
        decode = decode or min(self.cluster.decode, key=lambda d: (self._load[d.worker_id], d.worker_id))
        self._ensure_poller(decode)
        limit_s = time.monotonic() + self.cluster.config.request_timeout_s
        deadline_s = limit_s if deadline_s is None else min(deadline_s, limit_s)
        request = dataclasses.replace(request, deadline_s=time.time() + deadline_s - time.monotonic())
        queue: asyncio.Queue = asyncio.Queue()
        rid, key = request.request_id, (decode.worker_id, decode.epoch)
        self._queues[rid], self._instance_of[rid] = queue, key
        self._count_on(decode.worker_id, 1)
        finished, prefill_holds = False, True
        try:
            stream = prefill.prefill_worker.prefill(request, decode, self.client_id)
            first = await _first_token(stream, deadline_s, prefill)
            yield TokenChunk(
                (first.token_id,),
                (first.logprobs,) if first.logprobs else (),
                first.finish_reason,
                first.num_cached_tokens,
                first.pull,
                first.prompt_logprobs,
                first.text_end_chars,
            )
            if not first.handoff:  # done at prefill: nothing was reserved on decode
                finished = True
                return
            stats: HandoffStats = await _handoff(stream, deadline_s, prefill, decode)
            prefill_holds = False  # adopted: the prefill worker holds nothing of it any more
            for listener in self.handoff_listeners:
                listener(stats)
            async for chunk in self._decode_stream(queue, deadline_s):
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._queues.pop(rid, None)
            self._instance_of.pop(rid, None)
            self._count_on(decode.worker_id, -1)
            if not finished:  # a task of its own: the caller's task may be being cancelled right now
                cleanup = asyncio.ensure_future(self._cancel(rid, prefill if prefill_holds else None, decode))
                self._cleanups[rid] = cleanup
                cleanup.add_done_callback(lambda _: self._cleanups.pop(rid, None))

    def _count_on(self, decode_id: str, change: int) -> None:
        self._load[decode_id] += change
        if not self._load[decode_id]:
            del self._load[decode_id]  # a Counter keeps zeros: a fleet's worth of them over time
        for listener in self.decode_load_listeners:
            listener(decode_id)

    def _next_prefill(self) -> Member:
        members = self.cluster.prefill
        if not members:
            raise RequestFailed("no prefill worker is serving", unavailable=True)
        return members[next(self._prefill_turn) % len(members)]

    async def _decode_stream(self, queue, deadline_s) -> AsyncIterator[TokenChunk]:
        while True:
            left_s = deadline_s - time.monotonic()
            try:
                update: TokenUpdate | RequestFailed = await asyncio.wait_for(queue.get(), max(left_s, 0.0))
            except TimeoutError:
                raise RequestFailed("the request's deadline passed while decoding", timed_out=True) from None
            if isinstance(update, RequestFailed):  # its decode instance failed (see _fail_instance)
                update.phase = AttemptPhase.DECODE
                raise update
            if update.error is not None:
                raise RequestFailed(update.error, unavailable=True, phase=AttemptPhase.DECODE)
            yield TokenChunk(
                update.token_ids, update.logprobs, update.finish_reason, text_end_chars=update.text_end_chars
            )
            if update.finish_reason is not None:
                return

    async def _cancel(self, request_id: str, prefill: Member | None, decode: Member) -> None:
        """Frees what the request holds on its prefill worker (`None`: nothing left there) and on its
        decode instance (a reservation, or the running sequence)."""
        calls: list[Awaitable] = [decode.decode_instance.cancel(request_id)]
        if prefill is not None:  # first: its hand-off session then stops before reserving anything
            calls.insert(0, prefill.prefill_worker.abort(request_id))
        for call in calls:
            with contextlib.suppress(Exception):  # a dead worker has nothing left to free
                await asyncio.wait_for(call, self.cluster.config.handoff_lease_s + 5.0)

    def _ensure_poller(self, decode: Member) -> None:
        key = (decode.worker_id, decode.epoch)
        task = self._pollers.get(key)
        if task is None or task.done():
            self._pollers[key] = asyncio.ensure_future(self._poll(decode))

    async def _poll(self, decode: Member) -> None:
        """One long-poll loop per decode instance; fans each batch out to the requests' queues."""
        key = (decode.worker_id, decode.epoch)
        while True:
            try:
                updates = await decode.decode_instance.poll(self.client_id, POLL_WAIT_S)
            except (RayActorError, RayTaskError) as err:
                self._fail_instance(
                    key,
                    f"decode instance {decode.worker_id} is unavailable: {type(err).__name__}",
                    dead=isinstance(err, RayActorError),
                )
                self._pollers.pop(key, None)
                return
            for update in updates:  # an idle instance's poll blocks server-side up to POLL_WAIT_S
                queue = self._queues.get(update.request_id)
                if queue is not None:
                    queue.put_nowait(update)

    def _fail_instance(self, key: tuple[str, int], reason: str, dead: bool) -> None:
        for request_id, queue in self._queues.items():
            if self._instance_of.get(request_id) == key:
                queue.put_nowait(RequestFailed(reason, unavailable=True, lost_worker=key if dead else None))

    async def close(self) -> None:
        if self._cleanups:  # let aborts in flight reach the workers (each is bounded)
            await asyncio.wait(list(self._cleanups.values()), timeout=self.cluster.config.handoff_lease_s + 10.0)
        for task in self._pollers.values():
            task.cancel()
        self._pollers.clear()


async def _first_token(stream: AsyncIterator[PrefillEvent], deadline_s: float, prefill: Member) -> PrefillResult:
    """The first token from the prefill worker's stream, past its queue changes (a failure says whether the
    request was waiting in the worker's queue or being computed)."""
    what, waiting = f"prefill worker {prefill.worker_id}", False
    try:
        while isinstance(item := await _next(stream, deadline_s, what, prefill), PrefillQueue):
            waiting = item.waiting
        return item
    except RequestFailed as err:
        err.phase = AttemptPhase.QUEUED if waiting else AttemptPhase.PREFILL
        raise


async def _handoff(
    stream: AsyncIterator[PrefillEvent], deadline_s: float, prefill: Member, decode: Member
) -> HandoffStats:
    """The hand-off's outcome from the prefill worker's stream."""
    try:
        return await _next(stream, deadline_s, f"KV hand-off {prefill.worker_id} -> {decode.worker_id}", prefill)
    except RequestFailed as err:
        err.phase = AttemptPhase.HANDOFF
        raise


async def _next(stream: AsyncIterator[PrefillEvent], deadline_s: float, what: str, prefill: Member):
    """The next item of the prefill worker's stream, within the request's deadline; failures → RequestFailed."""
    try:
        return await asyncio.wait_for(anext(stream), max(deadline_s - time.monotonic(), 0.0))
    except StopAsyncIteration:
        raise RequestFailed(f"{what} ended the stream early", unavailable=True) from None
    except TimeoutError:
        raise RequestFailed(f"{what} did not answer before the request deadline", timed_out=True) from None
    except RayActorError as err:
        raise RequestFailed(
            f"{what} died: {err.__class__.__name__}", unavailable=True, lost_worker=(prefill.worker_id, prefill.epoch)
        ) from None
    except RayTaskError as err:
        cause = err.cause if hasattr(err, "cause") else err
        if isinstance(cause, InvalidRequestError):
            raise RequestFailed(str(cause), field=cause.field) from None
        if isinstance(cause, MemoryError):
            raise RequestFailed(f"{what}: {cause}", out_of_capacity=True) from None
        if time.monotonic() >= deadline_s:
            raise RequestFailed(f"{what}: the request's deadline passed ({cause})", timed_out=True) from None
        decode_lost = isinstance(cause, HandoffFailed) and cause.decode_lost
        raise RequestFailed(f"{what} failed: {cause}", unavailable=True, decode_lost=decode_lost) from None
