"""What this router has in flight on each worker: its own exact counts, for routing and admission.

Workers report their load too (`WorkerMonitor`), but only about once a second; these counts change
with every request this router sends, so routing and admission read them first.
- per prefill worker: requests in flight, and uncached prompt tokens queued for a first token;
- per decode instance: the streams decoding there (their progress: `StreamState`).
A request is booked on one prefill worker and one decode instance per route (`book`); its prompt
leaves the prefill queue at its first token (`first_token`); `release` ends the booking.
Each change of a prefill worker's counts is told to `listeners` (the router's `RoutableLoads` keeps
its load-ordered book with them, so routing never lists the pool's loads).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

from policies.admission import RunningRequest
from policies.routing import WorkerLoad
from router.stream_state import StreamState


class RouteLedger:
    def __init__(self):
        self._inflight: Counter[str] = Counter()  # prefill worker → requests in flight
        # prefill worker → uncached prompt tokens awaiting their first token
        self._queued_tokens: Counter[str] = Counter()
        self._decoding: dict[str, dict[str, StreamState]] = defaultdict(dict)  # decode worker → its streams
        self.listeners: list[Callable[[str], None]] = []  # called with a prefill worker's id after its counts change

    def book(self, request_id: str, prefill_id: str, decode_id: str, uncached_tokens: int, state: StreamState) -> None:
        self._inflight[prefill_id] += 1
        self._queued_tokens[prefill_id] += uncached_tokens
        self._decoding[decode_id][request_id] = state
        self._changed(prefill_id)

    def first_token(self, prefill_id: str, uncached_tokens: int) -> None:
        self._queued_tokens[prefill_id] -= uncached_tokens
        self._changed(prefill_id)

    def release(self, request_id: str, prefill_id: str, decode_id: str, queued_tokens: int) -> None:
        """Ends a booking; `queued_tokens`: what is still queued of it (0 once its first token came)."""
        self._queued_tokens[prefill_id] -= queued_tokens
        self._inflight[prefill_id] -= 1
        streams = self._decoding[decode_id]
        streams.pop(request_id, None)
        if not streams:
            del self._decoding[decode_id]
        self._changed(prefill_id)

    def _changed(self, prefill_id: str) -> None:
        if not self._inflight[prefill_id] and not self._queued_tokens[prefill_id]:
            # Counters keep zeros: drop them, or a long-lived router holds every worker it ever used
            self._inflight.pop(prefill_id, None)
            self._queued_tokens.pop(prefill_id, None)
        for listener in self.listeners:
            listener(prefill_id)

    def prefill_load(self, worker_id: str) -> WorkerLoad:
        return WorkerLoad(worker_id, self._inflight[worker_id], self._queued_tokens[worker_id])

    def inflight(self, prefill_id: str) -> int:
        return self._inflight[prefill_id]

    def running_on(self, decode_id: str) -> list[RunningRequest]:
        """The streams decoding on an instance, as admission sees them (tokens so far, budget, context)."""
        return [
            RunningRequest(s.num_tokens, s.request.params.max_tokens, len(s.request.prompt_token_ids) + s.num_tokens)
            for s in self._decoding.get(decode_id, {}).values()
        ]
