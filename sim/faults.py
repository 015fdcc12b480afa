"""Worker faults in a simulation: a worker dies, its requests migrate, a replacement comes back.

As in the cluster (router/service.py `_run`, cluster/controller.py): a dead worker leaves routing at
once and its prefix-index entries go; each request it was serving **migrates** — its prompt plus the
tokens already streamed are prefilled again on a live prefill worker (prefix-cache hits where they
exist) and decoding resumes — at most `migration_limit` times, else it fails; requests routed while
a pool has no live worker wait for one. After `restart_s` a replacement serves with an empty cache.
Which requests a death touches: those queued, prefilling or pinned for a hand-off on a dead prefill
worker; those booked on a dead decode instance (decoding there, adopted, or still prefilling: their
hand-off fails when it reaches the dead instance, as a real reservation does).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from sim.seq import SimSeq
from sim.worker import SimWorker

if TYPE_CHECKING:
    from sim.config import Fault
    from sim.simulator import Simulation


class FaultHandler:
    def __init__(self, sim: Simulation):
        self.sim = sim
        self.dead: set[tuple[str, int]] = set()  # (pool, index): "front" (prefill / colocated) or "decode"
        self.parked: deque[SimSeq] = deque()  # requests waiting for a pool to have a live worker

    def is_dead(self, worker: SimWorker) -> bool:
        """A worker object that died (its slot now holds a replacement, or nothing yet)."""
        pool = self.sim.decode if worker.role == "decode" else self.sim.front
        return pool[worker.index] is not worker or worker.dead

    def decode_dead(self, seq: SimSeq) -> bool:
        return bool(self.sim.decode) and ("decode", seq.decode_worker) in self.dead

    def on_fault(self, fault: Fault, _) -> None:
        sim = self.sim
        pool_name = "decode" if fault.role == "decode" else "front"
        pool = sim.decode if pool_name == "decode" else sim.front
        if (pool_name, fault.index) in self.dead:
            return
        worker = pool[fault.index]
        worker.dead = True
        self.dead.add((pool_name, fault.index))
        sim.router.set_alive(fault.role, fault.index, False)  # a dead prefill worker leaves the index too
        touched = [s for s in sim.active if self._touched(s, pool_name, fault.index)]
        for seq in sorted(touched, key=lambda s: s.index):  # a fixed order keeps runs deterministic
            emitted = worker.emitted_by(seq, sim.now_s) if seq.stage == "decode" else seq.emitted
            self._detach(seq, pool_name)
            self.migrate(seq, emitted)
        sim.restart_later((pool_name, fault.index))

    def _touched(self, seq: SimSeq, pool_name: str, index: int) -> bool:
        """Stages: routing and prefill (and colocated decode) belong to the front worker; a pinned
        request to both (its decode booking is only hit once it reserved or waits to); adopting and
        decode to the decode instance. A request still prefilling for a dead instance migrates when
        its hand-off would start (Simulation._first_token)."""
        if pool_name == "decode":
            return seq.decode_worker == index and seq.stage in ("pinned", "adopting", "decode")
        front_stages = ("routing", "prefill", "pinned") + (("decode",) if self.sim.config.colocated else ())
        return seq.prefill_worker == index and seq.stage in front_stages

    def _detach(self, seq: SimSeq, dead_pool: str) -> None:
        """Frees what the request holds on the workers that survive the fault."""
        sim = self.sim
        sim.handoffs.forget(seq)
        if seq.decode_blocks and dead_pool != "decode":
            sim.decode[seq.decode_worker].release_decode(seq)
            sim.handoffs.reserve_next(seq.decode_worker)
        if seq.table and dead_pool != "front":
            prefill = sim.front[seq.prefill_worker]
            prefill.release_prefill(seq)
            if prefill.kick(sim.now_s):
                sim.schedule(prefill)
        if seq.pull_table:  # pulled, never admitted: the pull served no prefill
            seq.pulled = 0
            if dead_pool != "front":
                sim.front[seq.prefill_worker].drop_pull(seq)
        seq.table, seq.decode_blocks, seq.pull_table = [], 0, []

    def migrate(self, seq: SimSeq, emitted: int) -> None:
        """Routes the request again from its prompt and the tokens it streamed (or fails it)."""
        sim = self.sim
        sim.release(seq)
        if sim.decode and seq.decode_worker >= 0:
            sim.router.decode_inflight.add(seq.decode_worker, -1)
            seq.decode_worker = -1
        seq.emitted = emitted
        if emitted >= seq.output:  # its last token was out before the fault
            sim.finish(seq)
            return
        seq.migrations += 1
        if seq.migrations > sim.config.migration_limit:
            sim.end(seq, "failed")
            return
        seq.prompt, seq.computed, seq.registered = seq.prompt_tokens + emitted, 0, 0
        sim.route(seq)

    def wait_for_workers(self, seq: SimSeq) -> None:
        self.parked.append(seq)

    def on_restart(self, key: tuple[str, int], _) -> None:
        sim = self.sim
        pool_name, index = key
        self.dead.discard(key)
        if pool_name == "decode":
            sim.decode[index] = sim.new_worker("decode", index)
            sim.router.set_alive("decode", index, True)
        else:
            sim.front[index] = sim.new_worker("colocated" if sim.config.colocated else "prefill", index)
            sim.handoffs.worker_restarted(index)
            sim.router.set_alive("prefill", index, True)
        parked, self.parked = self.parked, deque()
        for seq in parked:
            sim.route(seq)
