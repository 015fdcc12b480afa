"""One sequence's KV hand-off, prefill side: the single owner of its steps, its lease and every timeout.

A `HandoffSession` starts once the prefill worker has sampled the sequence's first token (its KV
blocks pinned) and runs reserve → layout check → announce → send → ack → release → adopt; the steps,
and why the reservation waits until the prefill is done, are in docs/architecture.md, KV hand-off.
This module owns their order and bounds: `_reserve` asks the decode instance for blocks when the
session starts, after the prefill, so a request queued for prefill never holds decode memory; it
retries a full pool with backoff until the request's deadline (the prefill pins stay: back-pressure,
not failure); every call is bounded by the request's deadline, the ack by the lease. Any failure
after the reservation cancels it on the decode side (best effort: a live instance's lease frees it
anyway) and raises `HandoffFailed` naming the step; `cancel()` (the request was aborted) stops the
session at its next step the same way. Workers are thin adapters around it: the decode instance is
reached through a `DecodeEndpoint`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from kvtransfer.handoff import HandoffTarget, RankTarget, call_timeout_s, layout_mismatch
from kvtransfer.transport import PeerGone


class DecodeFull(Exception):
    """The decode instance has no room for the sequence now (retry later)."""


class HandoffFailed(RuntimeError):
    """The hand-off could not complete; `step` names where it stopped. `decode_lost`: the decode
    instance itself failed (dead or unreachable), as opposed to a refusal or a timeout."""

    def __init__(self, step: str, reason: str, *, decode_lost: bool = False):
        super().__init__(f"KV hand-off failed at {step}: {reason}")
        self.step, self.reason, self.decode_lost = step, reason, decode_lost

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields intact
        return (_rebuild_failed, (self.step, self.reason, self.decode_lost))


def _rebuild_failed(step: str, reason: str, decode_lost: bool) -> HandoffFailed:
    return HandoffFailed(step, reason, decode_lost=decode_lost)


@dataclass(frozen=True)
class HandoffStats:
    """What a finished hand-off moved and how long it took (reservation excluded: that is queueing)."""

    num_bytes: int
    elapsed_s: float


@dataclass(frozen=True)
class HandoffTimeouts:
    call_s: float = 10.0  # a control call to the decode instance (reserve, adopt, cancel) answers within this
    full_backoff_min_s: float = 0.01  # first wait after "decode full"; doubles each time
    full_backoff_max_s: float = 0.25

    def __post_init__(self):
        if not (self.call_s > 0 and 0 < self.full_backoff_min_s <= self.full_backoff_max_s):
            raise ValueError(f"invalid hand-off timeouts {self}")


class DecodeEndpoint(ABC):
    """The decode instance as one hand-off sees it. Errors: `DecodeFull` from `reserve` when the pool is
    full; `HandoffFailed` for a refusal; any other exception means the instance failed."""

    @abstractmethod
    async def reserve(self, num_tokens: int) -> HandoffTarget:
        """Blocks for `num_tokens` of KV on every rank; the target names the ranks and the lease."""

    @abstractmethod
    def announce(self, rank: RankTarget) -> Awaitable[None]:
        """Tell `rank` to receive this sequence now; the awaitable ends when the rank has stored it."""

    @abstractmethod
    async def adopt(self) -> None:
        """Start decoding the sequence (its KV is in every rank's reserved blocks)."""

    @abstractmethod
    async def cancel(self) -> None:
        """Drop the reservation (idempotent; waits until no rank can still write into it)."""


class KVSender:
    """A worker's one way out for KV: transfers run one at a time on its single thread, and each is
    announced only after the previous one finished (announce → send → every ack), because a decode
    rank takes a sender's hand-offs strictly in announce order (`kvtransfer.receiver`)."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.turn = asyncio.Lock()


class HandoffSession:
    """Runs one hand-off (module docstring). `send(target)` moves the KV (blocking, run on the
    `sender`'s thread) and returns the bytes sent; `release()` drops the prefill pins (thread-safe).
    `deadline_s` (time.time()) is the request's: no step outlives it. `kv_layout` (the sender's
    `KVCacheStorage.layout`, and who it is) is compared with the reservation's before anything moves."""

    def __init__(
        self,
        request_id: str,
        num_tokens: int,
        endpoint: DecodeEndpoint,
        send: Callable[[HandoffTarget], int],
        release: Callable[[], object],
        sender: KVSender,
        deadline_s: float,
        timeouts: HandoffTimeouts = HandoffTimeouts(),
        kv_layout: tuple[str, str] | None = None,
    ):
        self.request_id, self.num_tokens, self.endpoint = request_id, num_tokens, endpoint
        self._send, self._release, self._sender = send, release, sender
        self._kv_layout = kv_layout
        self.deadline_s, self.timeouts = deadline_s, timeouts
        self._cancelled = asyncio.Event()
        self._reserved = False

    def cancel(self) -> None:
        """Stop at the next step (the request was aborted); the reservation, if any, is dropped."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """`cancel()` was called: a HandoffFailed from `run()` is the abort's, not a fault."""
        return self._cancelled.is_set()

    async def run(self) -> HandoffStats:
        try:
            target = await self._reserve()
            self._check_layout(target)
            started_s = time.perf_counter()
            num_bytes = await self._transfer(target)
        except BaseException:
            self._release()
            if self._reserved:
                await self._cancel_reservation()
            raise
        self._release()
        try:
            self._check_cancelled("adopt")
            await self._call("adopt", self.endpoint.adopt())
        except BaseException:
            await self._cancel_reservation()
            raise
        return HandoffStats(num_bytes, time.perf_counter() - started_s)

    async def _reserve(self) -> HandoffTarget:
        wait_s = self.timeouts.full_backoff_min_s
        while True:
            self._check_cancelled("reserve")
            try:
                target = await self._call("reserve", self.endpoint.reserve(self.num_tokens))
                self._reserved = True
                return target
            except DecodeFull:
                left_s = self.deadline_s - time.time()
                if left_s <= 0:
                    raise HandoffFailed(
                        "reserve", "the decode instance stayed full until the request's deadline"
                    ) from None
                await self._sleep_unless_cancelled(min(wait_s, left_s))
                wait_s = min(wait_s * 2, self.timeouts.full_backoff_max_s)

    def _check_layout(self, target: HandoffTarget) -> None:
        if self._kv_layout is None or not target.kv_layout:
            return
        sender, layout = self._kv_layout
        problem = layout_mismatch(sender, f"decode instance {target.instance_id!r}", layout, target.kv_layout)
        if problem is not None:
            raise HandoffFailed("reserve", problem)

    async def _transfer(self, target: HandoffTarget) -> int:
        """In the sender's turn: announce to every rank, send on the sender thread, wait for every copy."""
        async with self._sender.turn:
            self._check_cancelled("announce")
            return await self._announce_and_send(target)

    async def _announce_and_send(self, target: HandoffTarget) -> int:
        confirmations = [asyncio.ensure_future(self.endpoint.announce(rank)) for rank in target.ranks]
        try:
            loop = asyncio.get_running_loop()
            try:
                num_bytes = await loop.run_in_executor(self._sender.executor, self._send, target)
            except Exception as err:  # TransferError and anything else: named, decode side first
                # A rank's peer left the cluster (the decode instance is gone): a worker loss, not the request's.
                lost = isinstance(err, PeerGone)
                raise HandoffFailed("send", f"{type(err).__name__}: {err}", decode_lost=lost) from err
            wait_s = call_timeout_s(target.lease_deadline_s)
            try:
                await asyncio.wait_for(asyncio.gather(*confirmations), wait_s)
            except TimeoutError:
                raise HandoffFailed("ack", f"decode ranks did not confirm within {wait_s:.1f} s") from None
            except Exception as err:
                raise HandoffFailed("ack", f"{type(err).__name__}: {err}", decode_lost=True) from err
            return num_bytes
        finally:
            for confirmation in confirmations:
                confirmation.cancel()

    async def _call(self, step: str, call: Awaitable):
        timeout_s = min(self.timeouts.call_s, max(self.deadline_s - time.time(), 0.001))
        try:
            return await asyncio.wait_for(call, timeout_s)
        except (DecodeFull, HandoffFailed):
            raise
        except TimeoutError:
            raise HandoffFailed(
                step, f"the decode instance did not answer within {timeout_s:.1f} s", decode_lost=True
            ) from None
        except Exception as err:
            raise HandoffFailed(step, f"{type(err).__name__}: {err}", decode_lost=True) from err

    async def _cancel_reservation(self) -> None:
        with contextlib.suppress(Exception):  # dead or slow: its lease frees the blocks; nothing more to do here
            await asyncio.wait_for(self.endpoint.cancel(), self.timeouts.call_s)

    def _check_cancelled(self, step: str) -> None:
        if self._cancelled.is_set():
            raise HandoffFailed(step, f"{self.request_id!r} was aborted")

    async def _sleep_unless_cancelled(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._cancelled.wait(), seconds)
