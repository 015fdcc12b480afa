"""Peer-to-peer prefix reuse: a prefill worker fetches cached KV blocks from another prefill worker.

When the router sends a request to a worker other than the one holding the longest cached prefix
(the holder is busier), it may ask the chosen worker to pull that prefix from the holder over the
KV transport instead of recomputing it (`policies/prefix_pull.py` decides: estimated transfer
time below estimated recompute time). The blocks are bit copies of KV the holder computed for the
same tokens under the same hash namespace (model, block size, tenant), verified token by token on
the holder exactly as a local prefix hit is.

One pull, requester R and holder H, every wait bounded by the pull timeout:
1. R, on its engine thread, looks the prefix up locally (c blocks hit) and reserves blocks for the
   rest, pinning its local hits (`reserve_pull`); if R already has it all, or no room, no pull.
2. R registers the expectation (`KVReceiver`, fewer blocks allowed) and asks H (`export_prefix`).
3. H, on its engine thread, verifies and pins the blocks it still holds (`pin_export`) and answers
   how many it will send (0: none). Its sender thread then announces the transfer to R
   (`receive_prefix`, so R never waits on an idle channel), sends the hand-off protocol's header +
   one message per layer, takes R's ack, and releases its pins.
4. R waits for the receive, registers the received blocks in its prefix cache under their hashes
   (`commit_pull`: BlockStored events tell the index R holds them now) and keeps the prefix pinned
   until the request itself has its first token (or is aborted): nothing can evict it in between.
Any failure (holder dead or slow, transfer error, timeout) releases R's reservation and the request
is computed as if no pull had been asked: a pull can save time, never fail a request.

R receives pulls on a transport of its own, `pull_peer_id(R's peer id)`: two workers pulling from
each other at once then use two one-way channels (the transport allows one call per peer at a time,
and a pair's conversation must be one-way or alternate). Workers find each other through the
membership the controller pushes to them (`find_worker`), never by actor names. `PrefixPuller` plays
R and `PrefixExporter` plays H; the prefill actor only routes its calls to them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from common.messages import GenerateRequest, PullOutcome
from engine.block_hash import HashNamespace, hash_blocks
from engine.kv_cache_manager import CachedPrefix
from engine.llm_engine import LLMEngine
from kvtransfer.handoff import HandoffTarget, RankTarget, call_timeout_s, remaining_s, send_sequence_kv
from kvtransfer.receiver import KVReceiver
from kvtransfer.torch_dist import TorchDistTransport

log = logging.getLogger(__name__)
CANCEL_GRACE_S = 5.0  # a receive ends by its deadline plus transport slack; cancel waits that long more


def pull_peer_id(peer_id: str) -> str:
    """The transport id a prefill worker (transport id `peer_id`) receives pulled prefixes on."""
    return f"{peer_id}/pull-in"


def pull_table_id(request_id: str) -> str:
    """The block table that pins a pulled prefix on the requester until its request is scheduled."""
    return f"{request_id}#pull"


def export_table_id(requester_id: str, request_id: str) -> str:
    """The block table that pins an exported prefix on the holder while it is sent."""
    return f"export:{requester_id}:{request_id}"


class PullReservation(NamedTuple):
    num_local_blocks: int  # leading prefix blocks the requester already had cached (pinned)
    block_ids: tuple[int, ...]  # reserved for prefix blocks num_local_blocks, num_local_blocks + 1, ...


# ---- engine-thread steps (each runs whole between two engine steps) ------------------------------
def _prefix_hashes(engine: LLMEngine, token_ids, tenant: str, num_blocks: int):
    namespace = HashNamespace(engine.model_config.identity, engine.config.block_size, tenant)
    return hash_blocks(namespace, token_ids[: num_blocks * engine.config.block_size])


def reserve_pull(engine: LLMEngine, request_id: str, token_ids, tenant: str, num_blocks: int) -> PullReservation | None:
    """Pins the local part of the prefix and reserves blocks for the rest; None: nothing to pull
    (all of it is here already) or no room for it."""
    size, table = engine.config.block_size, pull_table_id(request_id)
    num_blocks = min(num_blocks, (len(token_ids) - 1) // size)  # the last token is always computed
    local = engine.kv.find_cached_prefix(token_ids, _prefix_hashes(engine, token_ids, tenant, num_blocks))
    if len(local.block_ids) >= num_blocks or engine.kv.has(table):
        return None
    if not engine.kv.can_allocate(table, num_blocks * size, local):
        return None
    block_ids = engine.kv.allocate(table, num_blocks * size, local)
    return PullReservation(len(local.block_ids), block_ids[len(local.block_ids) :])


def commit_pull(engine: LLMEngine, request_id: str, token_ids, tenant: str, num_blocks: int) -> int:
    """Registers the first `num_blocks` prefix blocks (local + received) as cached, then keeps exactly
    the cached prefix pinned (reserved blocks the holder did not fill go back). Returns its blocks."""
    size, table = engine.config.block_size, pull_table_id(request_id)
    hashes = _prefix_hashes(engine, token_ids, tenant, num_blocks)
    engine.kv.cache_blocks(table, token_ids, hashes, num_blocks * size)
    engine.kv.free(table)
    prefix = engine.kv.find_cached_prefix(token_ids, hashes)
    engine.kv.allocate(table, prefix.num_tokens, prefix)
    return len(prefix.block_ids)


def pin_export(engine: LLMEngine, table: str, token_ids, tenant: str, num_blocks: int) -> tuple[int, ...]:
    """Holder side: pins the leading cached blocks of the prefix (verified against the tokens)."""
    prefix: CachedPrefix = engine.kv.find_cached_prefix(
        token_ids, _prefix_hashes(engine, token_ids, tenant, num_blocks)
    )
    if not prefix.block_ids or engine.kv.has(table):
        return ()
    engine.kv.allocate(table, prefix.num_tokens, prefix)
    return prefix.block_ids


# ---- requester side ------------------------------------------------------------------------------
class PrefixPuller:
    """Pulls prefixes for one prefill worker (`worker_id`, transport id `peer_id`). `call_engine(fn)` runs
    fn(engine) on the engine thread and returns a concurrent Future (EngineLoop.call); `find_worker(id)`
    is the membership's actor handle of a prefill worker, or None."""

    def __init__(
        self,
        worker_id: str,
        peer_id: str,
        store_host: str,
        store_port: int,
        engine: LLMEngine,
        call_engine: Callable,
        find_worker: Callable,
        timeout_s: float,
        metrics,
    ):
        self.worker_id, self.peer_id, self.timeout_s, self.metrics = worker_id, peer_id, timeout_s, metrics
        self.transport = TorchDistTransport(pull_peer_id(peer_id), store_host, store_port)
        self.receiver = KVReceiver(self.transport, engine.runner.kv_cache)
        self.receive_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-pull-recv")
        self._call_engine = call_engine
        self.block_size = engine.config.block_size
        self.bytes_per_block = engine.runner.kv_cache.bytes_per_block  # as stored and sent (scales included)
        self._find_worker = find_worker

    async def pull(self, request: GenerateRequest) -> PullOutcome:
        """Fetches the request's prefix from its holder; never raises (a failure means recompute)."""
        started_s, rid, tokens = time.perf_counter(), request.request_id, request.token_ids
        spec = request.prefix_pull
        assert spec is not None, "pull() serves requests that ask for a pull"
        reservation = await self._engine(lambda e: reserve_pull(e, rid, tokens, request.tenant, spec.num_blocks))
        if reservation is None:
            self.metrics.prefix_pull_finished("skipped", 0)
            return PullOutcome(0, 0, time.perf_counter() - started_s, "nothing to pull or no room")
        deadline_s = time.time() + self.timeout_s
        self.receiver.expect(rid, reservation.block_ids, deadline_s, allow_fewer_blocks=True)
        try:
            received = await self._transfer(request, reservation, deadline_s)
            local = reservation.num_local_blocks
            await self._engine(lambda e: commit_pull(e, rid, tokens, request.tenant, local + received))
        except Exception as err:  # noqa: BLE001 - any failure: give the blocks back and compute the prompt instead
            await self._abandon(rid, deadline_s)
            self.metrics.prefix_pull_finished("failed", 0)
            return PullOutcome(0, 0, time.perf_counter() - started_s, f"{type(err).__name__}: {err}")
        finally:
            self.receiver.forget(rid)
        elapsed_s = time.perf_counter() - started_s
        self.metrics.prefix_pull_finished("pulled", received)
        self.metrics.observe_transfer("pull_in", received * self.bytes_per_block, elapsed_s)
        return PullOutcome(received, received * self.bytes_per_block, elapsed_s)

    async def _transfer(self, request: GenerateRequest, reservation: PullReservation, deadline_s: float) -> int:
        """Asks the holder to send, then waits for the receive; returns the blocks received."""
        spec = request.prefix_pull
        assert spec is not None, "pull() serves requests that ask for a pull"
        holder = self._find_worker(spec.holder_id)
        if holder is None:
            raise LookupError(f"{spec.holder_id} is not a live prefill worker")
        tokens = request.token_ids[: spec.num_blocks * self.block_size + 1]  # all the holder verifies
        count = await asyncio.wait_for(
            holder.export_prefix(
                self.worker_id,
                self.peer_id,
                request.request_id,
                tokens,
                request.tenant,
                reservation.num_local_blocks,
                spec.num_blocks,
            ),
            max(deadline_s - time.time(), 0.0),
        )
        if count == 0:
            raise LookupError(f"{spec.holder_id} no longer holds the prefix")
        wait_s = max(deadline_s - time.time(), 0.001)
        return await asyncio.get_running_loop().run_in_executor(None, self.receiver.wait, request.request_id, wait_s)

    async def _abandon(self, request_id: str, deadline_s: float) -> None:
        """Stops accepting the transfer, waits out a receive in progress, then frees the reservation."""
        wait_s = max(deadline_s - time.time(), 0.0) + CANCEL_GRACE_S
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.receiver.cancel, request_id, wait_s)
        except TimeoutError:  # a receive that outlives its deadline: its blocks must not be reused
            log.error("pull receive of %r still running after %.1f s; keeping its blocks", request_id, wait_s)
            return
        await self._engine(lambda e: e.release(pull_table_id(request_id)))

    async def _engine(self, fn):
        return await asyncio.wrap_future(self._call_engine(fn))

    def close(self) -> None:
        self.receive_pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()


# ---- holder side ---------------------------------------------------------------------------------
class PrefixExporter:
    """Serves pulls of one prefill worker's cached prefixes (the holder, transport id `peer_id`). Blocks
    go out on `transport` from `sender`, the worker's one sender thread (shared with its hand-offs);
    `call_engine` and `find_worker` are as for `PrefixPuller`."""

    def __init__(
        self,
        peer_id: str,
        transport: TorchDistTransport,
        engine: LLMEngine,
        call_engine: Callable,
        sender: ThreadPoolExecutor,
        find_worker: Callable,
        timeout_s: float,
        metrics,
    ):
        self.peer_id, self.transport, self.engine = peer_id, transport, engine
        self.timeout_s, self.metrics = timeout_s, metrics
        self._call_engine, self._sender, self._find_worker = call_engine, sender, find_worker

    async def export(
        self,
        requester_id: str,
        requester_peer: str,
        request_id: str,
        token_ids: tuple[int, ...],
        tenant: str,
        start_block: int,
        num_blocks: int,
    ) -> int:
        """Pins the prefix blocks this worker still holds and sends blocks [start_block, ...) to the
        requester; returns how many it will send."""
        table = export_table_id(requester_id, request_id)
        block_ids = await asyncio.wrap_future(
            self._call_engine(lambda engine: pin_export(engine, table, token_ids, tenant, num_blocks))
        )
        requester = self._find_worker(requester_id)
        if len(block_ids) <= start_block or requester is None:
            self._call_engine(lambda engine: engine.release(table))
            return 0
        deadline_s = time.time() + self.timeout_s
        self._sender.submit(
            self._serve, table, block_ids[start_block:], requester, requester_peer, request_id, deadline_s
        )
        return len(block_ids) - start_block

    def _serve(
        self, table: str, block_ids: tuple[int, ...], requester, requester_peer: str, request_id: str, deadline_s: float
    ) -> None:
        """The holder's part of a prefix pull, on the sender thread (pins released whatever happens)."""
        started_s = time.perf_counter()
        try:
            remaining_s(deadline_s)  # past it the requester gave up: announce nothing
            announced = requester.receive_prefix(self.peer_id, request_id)
            peer, kv = pull_peer_id(requester_peer), self.engine.runner.kv_cache
            target = HandoffTarget(peer, (RankTarget(peer, 0, kv.num_kv_heads),), (), deadline_s)
            num_bytes = send_sequence_kv(
                self.transport, kv, block_ids, len(block_ids) * self.engine.config.block_size, request_id, target
            )
            announced.future().result(timeout=call_timeout_s(deadline_s))
            self.metrics.observe_transfer("pull_out", num_bytes, time.perf_counter() - started_s)
        except Exception as err:  # noqa: BLE001 - the requester falls back to recomputing; nothing else to do here
            log.info("prefix pull %r for %s failed: %s: %s", request_id, requester_peer, type(err).__name__, err)
        finally:
            self._call_engine(lambda engine: engine.release(table))
