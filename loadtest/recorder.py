"""Turns one request's stream of `StreamEvent`s (or its error) into a `RequestRecord`.

The recorder is the only mutable state of a request in flight; the driver feeds it with times taken
on one monotonic clock (seconds from the run's start) and freezes it with `record()`, which works at
any point, so a request the bench cancels still reports the tokens it received.

When a backend could only guess tokens per message (an OpenAI server sending text without token ids:
one per chunk with text) and the server's final count differs, the count wins: the first message
keeps one token and the rest are spread evenly over the later messages (earlier ones take the
remainder), so TTFT stays the first content's arrival and ITLs still sum to last - first.
"""

from __future__ import annotations

from loadtest.plan import PlannedRequest
from loadtest.records import RequestRecord


class RequestRecorder:
    def __init__(self, planned: PlannedRequest, request_id: str, send_s: float):
        self.planned, self.request_id, self.send_s = planned, request_id, send_s
        self._messages: list[tuple[float, int]] = []  # (time from send, tokens) per message with tokens
        self._exact = True
        self._reported: int | None = None
        self._token_ids: list[int] = []
        self._migrations = 0
        self._end_s: float | None = None
        self._cached: int | None = None
        self._finish: str | None = None
        self._error: tuple[str, str] | None = None

    @property
    def done(self) -> bool:
        return self._end_s is not None

    def on_event(self, event, now_s: float) -> None:
        """One streamed message (a backend's `StreamEvent`) arrived at now_s."""
        if event.num_tokens:
            self._messages.append((now_s - self.send_s, event.num_tokens))
            self._exact = self._exact and event.exact
        self._token_ids.extend(event.token_ids)
        if event.cached_prompt_tokens is not None:  # the final count wins over an early one
            self._cached = event.cached_prompt_tokens
        if event.completion_tokens is not None:
            self._reported = event.completion_tokens
        if event.finish_reason:
            self._finish, self._migrations = event.finish_reason, event.migrations
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
        assert self._end_s is not None, "on_error ended it"
        code, reason = self._error or (None, None)
        p = self.planned
        return RequestRecord(
            self.request_id,
            p.index,
            p.arrival_s,
            self.send_s,
            p.num_prompt_tokens,
            p.max_tokens,
            self._token_times(),
            self._end_s - self.send_s,
            self._cached,
            None if self._error else self._finish,
            code,
            reason,
            p.slo.ttft_ms,
            p.slo.tpot_ms,
            p.priority,
            p.tenant,
            tuple(self._token_ids),
            self._migrations,
        )

    def _token_times(self) -> tuple[float, ...]:
        counted = sum(n for _, n in self._messages)
        if self._exact or self._reported is None or self._reported == counted or not self._messages:
            return tuple(t for t, n in self._messages for _ in range(n))
        total, times = self._reported, [t for t, _ in self._messages]
        if total <= len(times):
            return tuple(times[:total])
        later = len(times) - 1
        if later == 0:
            return (times[0],) * total
        share, extra = divmod(total - 1, later)
        return (times[0], *(t for i, t in enumerate(times[1:]) for _ in range(share + (i < extra))))
