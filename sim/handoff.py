"""Hand-offs in a simulation: a prefilled request's KV reserved on its decode instance, sent, adopted.

As in the cluster (kvtransfer/): a request whose prompt is prefilled is pinned until its decode
instance has blocks for its context (a full instance is waited for, in turn); then the prefill
worker's one sender sends its KV (`Transfer.seconds`: latency + bytes / bandwidth; a worker's hand-offs
go one at a time), its prefill blocks are released (they stay cached) and the decode instance adopts it
`Overheads.adopt_s` later. On a shared host (`SimConfig.host_handoff_cores`) a hand-off keeps cores busy
from its transfer's start to its adoption: the sender's and the receiver's threads copying and
importing the KV; the host's stretch counts the hand-offs in progress.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from sim.events import ADOPT, HANDOFF_DONE, HANDOFF_START
from sim.seq import SimSeq

if TYPE_CHECKING:
    from sim.simulator import Simulation


class HandOffs:
    def __init__(self, sim: Simulation, prefill_workers: int, decode_instances: int):
        self.sim = sim
        self.sender_free_s = [0.0] * prefill_workers  # each prefill worker sends one hand-off at a time
        self.waiting: list[deque[SimSeq]] = [deque() for _ in range(decode_instances)]  # for decode room
        self.in_progress: dict[SimSeq, int] = {}  # transfer started, not yet adopted: seq -> its attempt
        self.seconds = 0.0  # summed transfer time
        # Only a shared host with hand-off cores counts them: elsewhere (a planner's fleet) no event is spent.
        self.counted = sim.host is not None and sim.config.host_handoff_cores > 0

    def pin(self, seq: SimSeq) -> None:
        """The request's prompt is prefilled: it waits for room on its decode instance."""
        seq.stage = "pinned"
        self.waiting[seq.decode_worker].append(seq)
        self.reserve_next(seq.decode_worker)

    def reserve_next(self, decode: int) -> None:
        """Hand-offs waiting for this instance start in turn while its blocks allow."""
        sim = self.sim
        waiting, instance = self.waiting[decode], sim.decode[decode]
        while waiting and instance.reserve(waiting[0], sim.block_tokens):
            seq = waiting.popleft()
            start_s = max(sim.now_s, self.sender_free_s[seq.prefill_worker])
            num_bytes = seq.prompt * sim.profile.model.kv_bytes_per_token
            end_s = start_s + sim.profile.transfer.seconds(num_bytes)
            if sim.learns_costs:  # the router's pull planner learns the link from every hand-off
                sim.router.planner.observe_transfer(num_bytes, end_s - start_s)
            self.sender_free_s[seq.prefill_worker] = end_s
            self.seconds += end_s - start_s
            if self.counted and start_s > sim.now_s:
                sim.push(start_s, HANDOFF_START, seq, seq.migrations)
            elif self.counted:
                self.on_start(seq, seq.migrations)
            sim.push(end_s, HANDOFF_DONE, seq, seq.migrations)

    def on_start(self, seq: SimSeq, attempt: int) -> None:
        if attempt == seq.migrations:
            self.in_progress[seq] = attempt
            self.sim.handoffs_changed()

    def on_done(self, seq: SimSeq, attempt: int) -> None:
        """Its transfer ended: the prefill worker lets its blocks go, the instance adopts it later."""
        sim = self.sim
        if attempt != seq.migrations:  # it migrated meanwhile: this transfer failed
            self.over(seq, attempt)
            return
        if sim.admission is not None:  # the finished hand-off the workers report (its transfer alone)
            num_bytes = seq.prompt * sim.profile.model.kv_bytes_per_token
            sim.admission.observe_transfer(num_bytes, sim.profile.transfer.seconds(num_bytes))
        prefill = sim.front[seq.prefill_worker]
        prefill.release_prefill(seq)
        if prefill.kick(sim.now_s):
            sim.schedule(prefill)
        seq.stage = "adopting"
        adopt_s = max(sim.over.adopt_s + sim.over.jitter_s(sim.over.adopt_jitter_s, seq.index), 0.0)
        sim.push(sim.now_s + adopt_s, ADOPT, seq, attempt)

    def over(self, seq: SimSeq, attempt: int) -> None:
        """The hand-off of `attempt` no longer keeps the host busy (adopted, or failed)."""
        if self.in_progress.get(seq) == attempt:
            del self.in_progress[seq]
            self.sim.handoffs_changed()

    def forget(self, seq: SimSeq) -> None:
        """A fault detached the request: it waits for no room any more."""
        for waiting in self.waiting:
            if seq in waiting:
                waiting.remove(seq)

    def worker_restarted(self, prefill: int) -> None:
        self.sender_free_s[prefill] = self.sim.now_s
