"""Per-step token output of a decode instance, batched for each client.

Each request belongs to the client that reserved it (its `owner`). The engine thread pushes each
step's tokens; a client's `poll` drains everything pending for its own requests in one message,
waiting up to a bound when nothing is pending. Routing by owner matters: a poll left in flight by a
client that went away must not swallow another client's tokens. Tokens of one request that pile up
between polls are merged into one `TokenUpdate`.

Owners are routers: each polls every instance it has requests on, continuously. An owner that has
not polled for a while is gone (its process died): `stale_owners` names them so that the instance
can drop their requests instead of decoding for nobody.
"""

from __future__ import annotations

import asyncio
import threading
import time

from common.messages import TokenUpdate
from engine.llm_engine import LLMEngine
from engine.step_updates import SequenceUpdate


class Outbox:
    def __init__(self):
        self._lock = threading.Lock()
        self._owner_of: dict[str, str] = {}
        self._pending: dict[str, dict[str, TokenUpdate]] = {}  # owner → request id → update
        self._events: dict[str, asyncio.Event] = {}
        # Owners whose poll is waiting now. Only those are woken, once per wait: a wake is a write to the
        # event loop's socket and a switch of the GIL to the loop thread, costs the engine thread pays
        # mid-step, and one more per step while a poll is away (its router busy with the last answer)
        # would buy nothing: that poll finds the updates pending when it comes back.
        self._waiting: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_poll_s: dict[str, float] = {}  # owner → time.monotonic() of its latest poll

    def last_poll_s(self, owner: str) -> float | None:
        return self._last_poll_s.get(owner)

    def stale_owners(self, timeout_s: float) -> set[str]:
        """Owners that polled before but not within `timeout_s`."""
        now_s = time.monotonic()
        return {owner for owner, seen_s in self._last_poll_s.items() if now_s - seen_s > timeout_s}

    def requests_of(self, owners: set[str]) -> list[str]:
        with self._lock:
            return [rid for rid, owner in self._owner_of.items() if owner in owners]

    def drop_owner(self, owner: str) -> None:
        """Forget an owner that is gone (its undelivered updates too)."""
        with self._lock:
            self._pending.pop(owner, None)
            self._events.pop(owner, None)
            self._waiting.discard(owner)
            self._last_poll_s.pop(owner, None)

    def assign(self, request_id: str, owner: str) -> None:
        with self._lock:
            self._owner_of[request_id] = owner

    def push(self, update: TokenUpdate) -> None:
        """Thread-safe; merges with what is already pending for the request. Unowned: dropped."""
        self._wake(self._add([update]))

    def push_step(self, engine: LLMEngine, updates: list[SequenceUpdate]) -> None:
        """Engine thread: record a step's tokens (finished sequences leave the engine here), then wake
        each owner's poll once. Waking it per update would let the poll answer with the step's first
        update before the rest is in, and its router would come back for the remainder: one more
        round trip per step, each a Ray call on both processes' CPU."""
        tokens = []
        for update in updates:
            seq = engine.seqs.get(update.seq_id)
            if seq is None:
                continue
            count = len(update.new_token_ids)
            logprobs = tuple(seq.logprobs[-count:]) if seq.params.logprobs is not None and count else ()
            reason = None if update.finish_reason is None else update.finish_reason.value
            if reason is not None:
                engine.pop_finished(update.seq_id)
            tokens.append(
                TokenUpdate(update.seq_id, update.new_token_ids, logprobs, reason, text_end_chars=update.text_end_chars)
            )
        self._wake(self._add(tokens))

    def _add(self, updates: list[TokenUpdate]) -> tuple[asyncio.AbstractEventLoop | None, list[asyncio.Event]]:
        """Merges `updates` into their owners' pending ones; returns the polls' loop and the events of
        the owners to wake (both read under the lock, as `drain` sets them)."""
        owners: set[str] = set()
        with self._lock:
            for update in updates:
                owner = self._owner_of.get(update.request_id)
                if owner is None:
                    continue
                if update.finish_reason is not None or update.error is not None:
                    del self._owner_of[update.request_id]
                pending = self._pending.setdefault(owner, {})
                earlier = pending.get(update.request_id)
                if earlier is not None:
                    update = TokenUpdate(
                        update.request_id,
                        earlier.token_ids + update.token_ids,
                        earlier.logprobs + update.logprobs,
                        update.finish_reason,
                        update.error or earlier.error,
                        update.text_end_chars,
                    )
                pending[update.request_id] = update
                owners.add(owner)
            woken = owners & self._waiting
            self._waiting -= woken
            events = [event for event in (self._events.get(owner) for owner in woken) if event is not None]
            return self._loop, events

    @staticmethod
    def _wake(loop_and_events: tuple[asyncio.AbstractEventLoop | None, list[asyncio.Event]]) -> None:
        loop, events = loop_and_events
        if loop is not None:
            for event in events:
                loop.call_soon_threadsafe(event.set)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._owner_of.pop(request_id, None)

    async def drain(self, owner: str, max_wait_s: float) -> list[TokenUpdate]:
        self._last_poll_s[owner] = time.monotonic()
        with self._lock:
            self._loop = asyncio.get_running_loop()
            event = self._events.setdefault(owner, asyncio.Event())
            if not self._pending.get(owner):
                event.clear()
                self._waiting.add(owner)
                wait = True
            else:
                wait = False
        if wait:
            try:
                await asyncio.wait_for(event.wait(), max_wait_s)
            except TimeoutError:
                with self._lock:
                    self._waiting.discard(owner)
                return []
        with self._lock:
            updates = list(self._pending.pop(owner, {}).values())
        self._last_poll_s[owner] = time.monotonic()
        return updates
