"""One rank of a decode instance (a Ray actor). A decode instance is `tp_size` of these.

Every rank holds its shard of the model and its KV heads, and receives its part of each hand-off
(`receive_kv`, announced by the prefill worker). Rank 0 also runs the scheduler and sampler: it
reserves blocks (`reserve`), adopts sequences once their KV is in (`adopt`), continues them in a
continuous batch, and collects each step's tokens for the whole batch into an outbox that the client
drains with one `poll` call per round trip (never one remote call per token).
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from cluster.config import ClusterConfig
from cluster.messages import GenerateRequest, TokenUpdate, WorkerInfo
from cluster.worker_telemetry import WorkerTelemetry
from decode_worker.outbox import Outbox
from decode_worker.rank_setup import RankSetup, build_rank
from kvtransfer.receiver import KVReceiver
from engine.block_hash import spec_fingerprint
from engine.llm_engine import LLMEngine
from kvtransfer.handoff import HandoffTarget, RankTarget

LEASE_GRACE_S = 2.0  # clocks of two hosts may differ a little; blocks are freed only after this


class DecodeRank:
    def __init__(self, instance_id: str, rank: int, config: dict, model_dir: str, store_host: str,
                 store_port: int, follower_names: tuple[str, ...] = ()):
        self.config = ClusterConfig.from_dict(config)
        self.instance_id, self.rank = instance_id, rank
        self.peer_id = f"{instance_id}/rank{rank}"
        self.outbox = Outbox()
        self.telemetry = WorkerTelemetry(instance_id, "decode", self.config) if rank == 0 else None
        self.setup: RankSetup = build_rank(self, self.config, model_dir, store_host, store_port)
        self.receiver = KVReceiver(self.setup.transport, self.setup.runner.kv_cache)
        self._recv_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-recv")
        self._followers = [_actor(name) for name in follower_names]
        self._leases: dict[str, float] = {}  # rank 0: reserved, not yet adopted → deadline

    async def ready(self) -> WorkerInfo:
        cfg = self.setup.model_config
        return WorkerInfo(self.instance_id, "decode", (self.peer_id,), self.setup.num_blocks,
                          self.config.block_size, cfg.num_kv_heads, spec_fingerprint(), cfg.identity,
                          self.setup.max_model_len, cfg.vocab_size, cfg.eos_token_ids)

    # ---- every rank -------------------------------------------------------------------------------
    async def expect(self, request_id: str, block_ids: tuple[int, ...], deadline_s: float) -> None:
        self.receiver.expect(request_id, block_ids, deadline_s)

    async def receive_kv(self, prefill_peer: str, request_id: str) -> None:
        """Announced by the prefill worker right before it sends this rank's part of the KV."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._recv_pool, self.receiver.receive, prefill_peer, request_id)

    async def cancel_expected(self, request_id: str) -> None:
        await asyncio.get_running_loop().run_in_executor(
            None, self.receiver.cancel, request_id, self.config.handoff_lease_s + LEASE_GRACE_S)
        self.receiver.forget(request_id)

    # ---- rank 0 ---------------------------------------------------------------------------------
    async def reserve(self, request_id: str, num_tokens: int, owner: str) -> HandoffTarget:
        """Allocates blocks for `num_tokens` of incoming KV on every rank for client `owner` (whose
        `poll` gets the request's tokens); raises MemoryError if the pool is full."""
        block_ids = await self._call(lambda engine: engine.reserve(request_id, num_tokens))
        self.outbox.assign(request_id, owner)
        deadline_s = time.time() + self.config.handoff_lease_s
        self._leases[request_id] = deadline_s
        self.receiver.expect(request_id, block_ids, deadline_s)
        await asyncio.gather(*(f.expect.remote(request_id, block_ids, deadline_s) for f in self._followers))
        return HandoffTarget(self.instance_id, self._rank_targets(), block_ids, deadline_s)

    async def adopt(self, request: GenerateRequest, first_token_id: int) -> None:
        """Continues a request whose prompt KV arrived (every rank acked the prefill worker)."""
        rid = request.request_id
        await asyncio.get_running_loop().run_in_executor(None, self.receiver.wait, rid, 1.0)
        self._leases.pop(rid, None)
        self.receiver.forget(rid)
        tokens = tuple(request.prompt_token_ids) + (first_token_id,)
        await self._call(lambda engine: engine.adopt(rid, tokens, len(request.prompt_token_ids), request.params,
                                                     priority=request.priority, tenant_salt=request.tenant))
        await asyncio.gather(*(f.cancel_expected.remote(rid) for f in self._followers))

    async def cancel(self, request_id: str) -> None:
        """Abort a running request, or drop a reservation (after no rank can still write into it)."""
        self._leases.pop(request_id, None)
        await asyncio.gather(self.cancel_expected(request_id),
                             *(f.cancel_expected.remote(request_id) for f in self._followers))
        await self._call(lambda engine: _abort_or_release(engine, request_id))
        self.outbox.forget(request_id)

    async def poll(self, owner: str, max_wait_s: float) -> list[TokenUpdate]:
        """Everything produced for `owner`'s requests since its last poll, waiting up to `max_wait_s`."""
        self._expire_leases()
        return await self.outbox.drain(owner, max_wait_s)

    async def check_integrity(self) -> dict:
        def check(engine: LLMEngine) -> dict:
            engine.kv.check_integrity()
            return {"num_blocks": engine.num_blocks, "num_free_blocks": engine.kv.num_free_blocks,
                    "num_sequences": len(engine.seqs)}
        return await self._call(check)

    async def stats(self) -> dict:
        """Rank 0: load, recent engine steps and this instance's metrics (see WorkerTelemetry)."""
        stats = await self._call(lambda engine: self.telemetry.engine_stats(engine, self.setup.loop.step_log))
        return {**stats, "reservations": len(self._leases)}

    async def debug_set_receive_delay(self, seconds: float) -> None:
        """Fault injection for tests: stall each KV receive by `seconds`."""
        self.receiver.delay_s = seconds

    def shutdown(self) -> None:
        if self.telemetry is not None:
            self.telemetry.close()
        self.setup.close()
        self._recv_pool.shutdown(wait=False, cancel_futures=True)

    def _rank_targets(self) -> tuple[RankTarget, ...]:
        cfg, size = self.setup.model_config, self.config.decode.tp_size
        heads_per_rank = max(1, cfg.num_kv_heads // size)
        replicas = max(1, size // cfg.num_kv_heads)  # KV heads replicated when ranks outnumber them
        return tuple(RankTarget(f"{self.instance_id}/rank{r}", (r // replicas) * heads_per_rank,
                                (r // replicas) * heads_per_rank + heads_per_rank) for r in range(size))

    def _expire_leases(self) -> None:
        now_s = time.time()
        for rid in [rid for rid, deadline in self._leases.items() if now_s > deadline + LEASE_GRACE_S]:
            self._leases.pop(rid, None)
            self.outbox.push(TokenUpdate(rid, (), (), error=f"the KV of {rid!r} did not arrive within the "
                                                            f"{self.config.handoff_lease_s:.0f} s lease"))
            asyncio.ensure_future(self.cancel(rid))

    async def _call(self, fn):
        return await asyncio.wrap_future(self.setup.loop.call(fn))


def _abort_or_release(engine: LLMEngine, request_id: str) -> None:
    if not engine.abort_request(request_id) and engine.kv.has(request_id):
        engine.release(request_id)  # a reservation that was never adopted


def _actor(name: str):
    import ray

    return ray.get_actor(name)
