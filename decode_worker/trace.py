"""The span of each request on a decode instance (common/tracing.py; docs/operations.md#tracing):
`splitserve.decode`, a child of the prefill worker's hand-off, from adoption to the last tokens a router
collected (or its cancellation). With tracing off, or for a request that carries no trace context, nothing
is kept."""

from __future__ import annotations

from common import tracing
from common.messages import GenerateRequest, TokenUpdate


class DecodeSpans:
    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._open: dict[str, tuple[object, list[int]]] = {}  # attempt id → (span, [tokens delivered])

    def adopted(self, request: GenerateRequest) -> None:
        if request.trace_context is None or not tracing.enabled():
            return
        span = tracing.start(
            "splitserve.decode",
            request.trace_context,
            kind="server",
            worker=self.worker_id,
            attempt_id=request.request_id,
            context_tokens=len(request.token_ids) + 1,
        )
        self._open[request.request_id] = (span, [0])

    def delivered(self, updates: list[TokenUpdate]) -> None:
        """A router collected these updates; a finished (or failed) request's span ends."""
        if not self._open:
            return
        for update in updates:
            entry = self._open.get(update.request_id)
            if entry is None:
                continue
            entry[1][0] += len(update.token_ids)
            if update.finish_reason is not None or update.error is not None:
                del self._open[update.request_id]
                tracing.end(entry[0], update.error, output_tokens=entry[1][0], finish_reason=update.finish_reason)

    def cancelled(self, request_id: str) -> None:
        entry = self._open.pop(request_id, None)
        if entry is not None:
            tracing.end(entry[0], "cancelled", output_tokens=entry[1][0])
