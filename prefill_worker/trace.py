"""The spans of one request on a prefill worker (common/tracing.py; docs/operations.md#tracing): the
worker's whole part (`splitserve.prefill`, a child of the router's attempt), its prefix pull, its wait in
the queue, its computation (with the chunks it took) and its KV hand-off, whose context travels on to the
decode instance in the request it adopts. Off, `start` returns an object whose every method returns at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from common import tracing
from common.messages import GenerateRequest, PrefillResult, PrefixPull
from kvtransfer.session import HandoffStats


class PrefillTrace:
    def __init__(self, span, request_id: str):
        self._span, self._request_id = span, request_id
        self._here = tracing.context_of(span, request_id)  # the parent of this worker's other spans
        self._enqueued_ns = time.time_ns()
        self._handoff = None

    @classmethod
    def start(cls, request: GenerateRequest, worker_id: str) -> PrefillTrace:
        if request.trace_context is None or not tracing.enabled():
            return _OFF
        span = tracing.start(
            "splitserve.prefill",
            request.trace_context,
            kind="server",
            worker=worker_id,
            attempt_id=request.request_id,
            context_tokens=len(request.token_ids),
        )
        return cls(span, request.trace_context.request_id)

    def pulling(self, pull: PrefixPull):
        return tracing.span("splitserve.prefix_pull", self._here, holder=pull.holder_id, blocks=pull.num_blocks)

    def enqueued(self) -> None:
        self._enqueued_ns = time.time_ns()

    def computed(self, result: PrefillResult, chunks: list[tuple[int, int]]) -> None:
        """The first token is out: the queue wait (until the first chunk) and the computation are known."""
        now_ns = time.time_ns()
        scheduled_ns = chunks[0][0] if chunks else now_ns
        tracing.record("splitserve.queue", self._here, self._enqueued_ns, scheduled_ns)
        tracing.record(
            "splitserve.prefill.compute",
            self._here,
            scheduled_ns,
            now_ns,
            chunks=len(chunks),
            chunk_tokens=[tokens for _, tokens in chunks],
            cached_tokens=result.num_cached_tokens,
        )

    def handing_off(self, request: GenerateRequest, decode_id: str) -> GenerateRequest:
        """Starts the hand-off's span; the request the decode instance adopts carries its context."""
        self._handoff = tracing.start("splitserve.handoff", self._here, decode_worker=decode_id)
        return dataclasses.replace(request, trace_context=tracing.context_of(self._handoff, self._request_id))

    def handed_off(self, stats: HandoffStats | None) -> None:
        if stats is None:
            tracing.end(self._handoff, "aborted")
        else:
            tracing.end(self._handoff, kv_bytes=stats.num_bytes)
        self._handoff = None

    def failed(self, err: BaseException) -> None:
        tracing.fail(self._span, type(err).__name__)
        if self._handoff is not None:
            tracing.end(self._handoff, type(err).__name__)
            self._handoff = None

    def end(self) -> None:
        tracing.end(self._span)


class _Off(PrefillTrace):
    def __init__(self):
        pass

    def pulling(self, pull: PrefixPull):
        return contextlib.nullcontext()

    def enqueued(self) -> None:
        pass

    def computed(self, result: PrefillResult, chunks: list[tuple[int, int]]) -> None:
        pass

    def handing_off(self, request: GenerateRequest, decode_id: str) -> GenerateRequest:
        return request

    def handed_off(self, stats: HandoffStats | None) -> None:
        pass

    def failed(self, err: BaseException) -> None:
        pass

    def end(self) -> None:
        pass


_OFF = _Off()
