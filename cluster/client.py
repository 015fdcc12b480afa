"""The cluster's request API: submit a request, iterate its tokens (what the router builds on).

One request's lifecycle (DESIGN.md steps 3–6), every wait bounded:
1. pick a prefill worker and a decode instance; the decode instance reserves blocks for the prompt;
2. the prefill worker computes the prompt and returns the first token (streamed at once: TTFT);
3. the KV moves to the decode ranks; `wait_handoff` reports the transfer's end;
4. the decode instance adopts the sequence; its per-step outputs arrive through one poller per
   instance and are fanned out to the requests' queues.
Failures end the stream with `RequestFailed` naming the reason; reservations and pins are released.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError

from cluster.launcher import DecodeInstance, LaunchedCluster, PrefillHandle
from cluster.messages import GenerateRequest, PullOutcome, TokenUpdate
from engine.errors import InvalidRequestError

POLL_WAIT_S = 0.2


class RequestFailed(RuntimeError):
    """A request could not complete. `unavailable` marks worker loss (retry-safe before the first
    token); `timed_out` its deadline passing; otherwise the request itself was refused (`field` names
    the bad input, if any)."""

    def __init__(self, reason: str, *, unavailable: bool = False, field: str | None = None,
                 timed_out: bool = False, out_of_capacity: bool = False):
        super().__init__(reason)
        self.reason, self.unavailable, self.field, self.timed_out = reason, unavailable, field, timed_out
        self.out_of_capacity = out_of_capacity  # a worker's KV pool is full now: retry later


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    logprobs: tuple
    finish_reason: str | None
    num_cached_tokens: int = 0  # first chunk: prompt tokens the prefill worker had cached (pulled included)
    pull: PullOutcome | None = None  # first chunk: the prefix pull the request asked for, if any


class ClusterClient:
    def __init__(self, cluster: LaunchedCluster):
        self.cluster = cluster
        self._prefill_cycle = itertools.cycle(cluster.prefill)
        self._queues: dict[str, asyncio.Queue] = {}
        self._load = {instance.instance_id: 0 for instance in cluster.decode}
        self._pollers: dict[str, asyncio.Task] = {}
        self._instance_of: dict[str, str] = {}  # request id → decode instance id
        self.client_id = secrets.token_hex(4)  # decode instances route this client's tokens by it
        self._cleanups: dict[str, asyncio.Task] = {}  # request id → abort in progress on its workers
        self.handoff_listeners: list = []  # called with each finished hand-off's HandoffStats (cost models)

    def is_active(self, request_id: str) -> bool:
        """True while the request streams or its abort has not reached its workers yet."""
        return request_id in self._queues or request_id in self._cleanups

    @property
    def num_cleanups(self) -> int:
        return len(self._cleanups)

    def decode_load(self, instance_id: str) -> int:
        """Requests this client has in flight on a decode instance."""
        return self._load[instance_id]

    async def generate(self, request: GenerateRequest, prefill: PrefillHandle | None = None,
                       decode: DecodeInstance | None = None,
                       deadline_s: float | None = None) -> AsyncIterator[TokenChunk]:
        """Streams the request's tokens. `deadline_s` (time.monotonic) bounds it, and so does the
        config's request_timeout_s. Leaving early (cancel, deadline, error) aborts it on both workers."""
        prefill = prefill or next(self._prefill_cycle)
        decode = decode or min(self.cluster.decode, key=lambda d: self._load[d.instance_id])
        self._ensure_poller(decode)
        limit_s = time.monotonic() + self.cluster.config.request_timeout_s
        deadline_s = limit_s if deadline_s is None else min(deadline_s, limit_s)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._instance_of[request.request_id] = decode.instance_id
        self._load[decode.instance_id] += 1
        finished, prefill_holds = False, True
        try:
            first = await self._prefill(request, prefill, decode, deadline_s)
            prefill_holds = first.handoff  # finished there: the prefill worker keeps nothing of it
            yield TokenChunk((first.token_id,), (first.logprobs,) if first.logprobs else (), first.finish_reason,
                             first.num_cached_tokens, first.pull)
            if not first.handoff:  # done at prefill: `finished` stays False so the decode reservation is freed
                return
            await self._handoff(request, prefill, decode, first, deadline_s)
            async for chunk in self._decode_stream(queue, decode, deadline_s):
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._queues.pop(request.request_id, None)
            self._instance_of.pop(request.request_id, None)
            self._load[decode.instance_id] -= 1
            if not finished:  # a task of its own: the caller's task may be being cancelled right now
                cleanup = asyncio.ensure_future(self._cancel(request.request_id, prefill if prefill_holds else None,
                                                             decode))
                self._cleanups[request.request_id] = cleanup
                cleanup.add_done_callback(lambda _: self._cleanups.pop(request.request_id, None))

    async def _prefill(self, request, prefill, decode, deadline_s):
        target = await _bounded(decode.driver.reserve.remote(request.request_id, len(request.prompt_token_ids),
                                                             self.client_id),
                                deadline_s, f"decode instance {decode.instance_id}")
        return await _bounded(prefill.actor.prefill.remote(request, target), deadline_s,
                              f"prefill worker {prefill.worker_id}")

    async def _handoff(self, request, prefill, decode, first, deadline_s) -> None:
        stats = await _bounded(prefill.actor.wait_handoff.remote(request.request_id), deadline_s,
                               f"KV hand-off {prefill.worker_id} -> {decode.instance_id}")
        for listener in self.handoff_listeners:
            listener(stats)
        await _bounded(decode.driver.adopt.remote(request, first.token_id), deadline_s,
                       f"decode instance {decode.instance_id}")

    async def _decode_stream(self, queue, decode, deadline_s) -> AsyncIterator[TokenChunk]:
        while True:
            left_s = deadline_s - time.monotonic()
            try:
                update: TokenUpdate = await asyncio.wait_for(queue.get(), max(left_s, 0.0))
            except asyncio.TimeoutError:
                raise RequestFailed("the request's deadline passed while decoding", timed_out=True) from None
            if update.error is not None:
                raise RequestFailed(update.error, unavailable=True)
            yield TokenChunk(update.token_ids, update.logprobs, update.finish_reason)
            if update.finish_reason is not None:
                return

    async def _cancel(self, request_id: str, prefill: PrefillHandle | None, decode: DecodeInstance) -> None:
        """Frees what the request holds on its prefill worker (`None`: nothing, it finished there) and its
        decode reservation."""
        calls = [decode.driver.cancel.remote(request_id)]
        if prefill is not None:
            calls.insert(0, prefill.actor.abort.remote(request_id))
        for call in calls:
            try:
                await asyncio.wait_for(call, self.cluster.config.handoff_lease_s + 5.0)
            except Exception:  # a dead worker has nothing left to free
                pass

    def _ensure_poller(self, decode: DecodeInstance) -> None:
        task = self._pollers.get(decode.instance_id)
        if task is None or task.done():
            self._pollers[decode.instance_id] = asyncio.ensure_future(self._poll(decode))

    async def _poll(self, decode: DecodeInstance) -> None:
        """One long-poll loop per decode instance; fans each batch out to the requests' queues."""
        while True:
            try:
                updates = await decode.driver.poll.remote(self.client_id, POLL_WAIT_S)
            except (RayActorError, RayTaskError) as err:
                self._fail_instance(decode, f"decode instance {decode.instance_id} is unavailable: {err}")
                return
            for update in updates:  # an idle instance's poll blocks server-side up to POLL_WAIT_S
                queue = self._queues.get(update.request_id)
                if queue is not None:
                    queue.put_nowait(update)

    def _fail_instance(self, decode: DecodeInstance, reason: str) -> None:
        for request_id, queue in self._queues.items():
            if self._instance_of.get(request_id) == decode.instance_id:
                queue.put_nowait(TokenUpdate(request_id, (), (), error=reason))

    async def close(self) -> None:
        if self._cleanups:  # let aborts in flight reach the workers (each is bounded)
            await asyncio.wait(list(self._cleanups.values()), timeout=self.cluster.config.handoff_lease_s + 10.0)
        for task in self._pollers.values():
            task.cancel()
        self._pollers.clear()


async def _bounded(ref, deadline_s: float, what: str):
    """Await a Ray call with the request's deadline; translate failures into RequestFailed."""
    try:
        return await asyncio.wait_for(ref, max(deadline_s - time.monotonic(), 0.0))
    except asyncio.TimeoutError:
        raise RequestFailed(f"{what} did not answer before the request deadline", timed_out=True) from None
    except RayActorError as err:
        raise RequestFailed(f"{what} died: {err.__class__.__name__}", unavailable=True) from None
    except RayTaskError as err:
        cause = err.cause if hasattr(err, "cause") else err
        if isinstance(cause, InvalidRequestError):
            raise RequestFailed(str(cause), field=cause.field) from None
        if isinstance(cause, MemoryError):
            raise RequestFailed(f"{what}: {cause}", out_of_capacity=True) from None
        raise RequestFailed(f"{what} failed: {cause}", unavailable=True) from None
