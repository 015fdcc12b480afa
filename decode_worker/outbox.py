"""Per-step token output of a decode instance, batched for the client.

The engine thread pushes each step's tokens; the actor's `poll` drains everything pending in one
message, waiting up to a bound when nothing is pending. Tokens of one request that accumulate
between polls are merged into one `TokenUpdate`.
"""
from __future__ import annotations

import asyncio
import threading

from cluster.messages import TokenUpdate
from engine.llm_engine import LLMEngine, SequenceUpdate


class Outbox:
    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[str, TokenUpdate] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def push(self, update: TokenUpdate) -> None:
        """Thread-safe; merges with what is already pending for the request."""
        with self._lock:
            earlier = self._pending.get(update.request_id)
            if earlier is not None:
                update = TokenUpdate(update.request_id, earlier.token_ids + update.token_ids,
                                     earlier.logprobs + update.logprobs, update.finish_reason,
                                     update.error or earlier.error)
            self._pending[update.request_id] = update
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)

    def push_step(self, engine: LLMEngine, updates: list[SequenceUpdate]) -> None:
        """Engine thread: record a step's tokens; finished sequences leave the engine here."""
        for update in updates:
            seq = engine.seqs.get(update.seq_id)
            if seq is None:
                continue
            logprobs = tuple(seq.logprobs[-len(update.new_token_ids):]) if seq.params.logprobs is not None else ()
            reason = None if update.finish_reason is None else update.finish_reason.value
            if reason is not None:
                engine.pop_finished(update.seq_id)
            self.push(TokenUpdate(update.seq_id, update.new_token_ids, logprobs, reason))

    async def drain(self, max_wait_s: float) -> list[TokenUpdate]:
        if self._event is None:
            self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        with self._lock:
            empty = not self._pending
            if empty:
                self._event.clear()
        if empty:
            try:
                await asyncio.wait_for(self._event.wait(), max_wait_s)
            except asyncio.TimeoutError:
                return []
        with self._lock:
            updates, self._pending = list(self._pending.values()), {}
        return updates
