"""Turns one request's stream of `GenerateChunk`s (or its error) into a `RequestRecord`.

The recorder is the only mutable state of a request in flight; the driver feeds it with times taken
on one monotonic clock (seconds from the run's start) and freezes it with `record()`, which works at
any point, so a request the bench cancels still reports the tokens it received.
"""
from __future__ import annotations

from loadtest.plan import PlannedRequest
from loadtest.records import RequestRecord


class RequestRecorder:
    def __init__(self, planned: PlannedRequest, request_id: str, send_s: float):
        self.planned, self.request_id, self.send_s = planned, request_id, send_s
        self._token_times_s: list[float] = []
        self._token_ids: list[int] = []
        self._migrations = 0
        self._end_s: float | None = None
        self._cached: int | None = None
        self._finish: str | None = None
        self._error: tuple[str, str] | None = None

    @property
    def done(self) -> bool:
        return self._end_s is not None

    def on_chunk(self, chunk, now_s: float) -> None:
        """One streamed message (an SDK `GenerateChunk`) arrived at now_s."""
        self._token_times_s.extend([now_s - self.send_s] * len(chunk.token_ids))
        self._token_ids.extend(chunk.token_ids)
        if chunk.route is not None:
            self._cached = chunk.route.cached_prompt_tokens
        if chunk.usage is not None:  # the final count wins over the route's early one
            self._cached = chunk.usage.cached_prompt_tokens
        if chunk.finish_reason:
            self._finish, self._migrations = chunk.finish_reason, chunk.migrations
            self._end_s = now_s

    def on_error(self, code: str, reason: str, now_s: float) -> None:
        """The call failed (a gRPC status name) or was ended by the bench; the first error sticks."""
        if self._error is None:
            self._error, self._end_s = (code, reason), now_s

    def on_stream_end(self, now_s: float) -> None:
        """The stream closed; without a finish reason that is a protocol violation worth recording."""
        if self._end_s is None:
            self.on_error("CLIENT_ERROR", "stream ended without a finish reason", now_s)

    def record(self, now_s: float) -> RequestRecord:
        """The record as of now_s (still-running requests end at now_s, marked CANCELLED)."""
        if self._end_s is None:
            self.on_error("CANCELLED", "still running when the bench stopped", now_s)
        code, reason = self._error or (None, None)
        p = self.planned
        return RequestRecord(self.request_id, p.index, p.arrival_s, self.send_s, p.num_prompt_tokens, p.max_tokens,
                             tuple(self._token_times_s), self._end_s - self.send_s, self._cached,
                             None if self._error else self._finish, code, reason,
                             p.slo.ttft_ms, p.slo.tpot_ms, p.priority, p.tenant, tuple(self._token_ids),
                             self._migrations)
