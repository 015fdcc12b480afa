"""The discrete-event model of a whole cluster: `simulate(config, profile, requests) -> SimResult`.

Why it is part of the product (beside the workers, not in benchmarks/): the controller's online
planner (cluster/planner.py) asks it which pool sizes meet the SLO, and the product may not import
benchmarks. It imports only downward, and runs the router's own parts where they exist: the routing
policy objects (`policies.routing`), the in-process prefix index (`prefix_index.memory`) fed by the
workers' real `BlockPool` events and the prefix-pull planner (sim/router.py), the admission gate and
policy objects (`policies.admission`) fed the workers' simulated step reports (sim/admission.py), and
the engine's `BlockPool`; what it models is the engine's scheduling and step times (sim/worker.py),
the hand-offs and the cluster's overheads.
Workloads reach it as plain `SimRequest` lists (the generators of `splitserve bench` live above it,
in loadtest/, and feed it from there).

A request's life, as in the cluster (README "A request through the disaggregated cluster"):
1. the client sends it at its arrival (or later, under the client's concurrency cap);
2. the router refuses it for its concurrency limit, or routes it: a prefill worker by the router's
   policy object (`SimConfig.policy`, `policies.routing.make_policy`), the decode instance with the
   fewest requests in flight; then the router's admission policy (`SimConfig.admission`, through the
   router's `AdmissionGate`) admits it on that route or refuses it with its cause (`SimRecord.refusal`);
   after `route` it is queued there
   (a request that finds nothing in flight waits the idle wake-up too, `Overheads.wake_s`);
   with `SimConfig.prefix_pull` on, the router's `PullPlanner` may ask the prefill worker to pull the
   prompt's prefix from a worker holding more of it: as the request reaches the worker, the blocks the
   holder still holds are copied into the worker's pool (cached, pinned until the request is
   admitted) and the request cannot be admitted before the KV's modelled transfer (`Profile.transfer`)
   has ended; pulled tokens count as cached, as the engine counts them;
3. the prefill worker's batched chunked prefill (sim/worker.py) reaches its prompt's end:
   the first token reaches the client `first_token` later;
4. hand-off (sim/handoff.py): blocks for its context are reserved on the decode instance (a
   full instance is waited for), the KV goes over the prefill worker's one sender (latency + bytes /
   bandwidth, in turn), its prefill blocks are released (they stay cached), the decode instance
   adopts it `adopt` later;
5. it decodes in the instance's continuous batch; its last token reaches the client `token` later.
Colocated workers do 3 and 5 in one batch. Worker faults migrate requests (sim/faults.py).
Workers sharing one host's cores (`host_cores`) step slower while more of them are busy
(sim/contention.py).
Time is simulated: a run is deterministic and reads no clock except to report its own speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import time
from collections import deque
from collections.abc import Iterator, Sequence

from common.messages import PullOutcome
from policies.admission import PrefillStep
from policies.routing.prefix_hash import DEFAULT_PREFIX_BLOCKS
from sim.admission import SimAdmission, admission_config
from sim.config import SimConfig
from sim.contention import SharedHost, host_share
from sim.events import ARRIVE, ENQUEUE, FAULT, HEARTBEAT, PULL_DONE, RESTART, WORKER
from sim.faults import FaultHandler
from sim.handoff import HandOffs
from sim.kv import BlockCounter, PrefixPool
from sim.profile import Profile
from sim.result import SimResult
from sim.router import INDEX_LEASE_S, PrefillChoice, SimRouter
from sim.seq import SimRequest, SimSeq, block_hashes, shared_keys, useful_keys
from sim.worker import SimWorker

YOUNG_GC_THRESHOLD = 50_000  # allocations between young collections during a run (Python's default: 700)


def simulate(config: SimConfig, profile: Profile, requests: Sequence[SimRequest]) -> SimResult:
    return Simulation(config, profile).run(requests)


class Simulation:
    def __init__(self, config: SimConfig, profile: Profile):
        self.config, self.profile = config, profile
        self.block_tokens = config.cache_block_tokens or profile.model.block_size
        self.over = profile.overheads
        self.host = None if config.host_cores is None else SharedHost(host_share(config, profile.threads_per_worker))
        prefill_pool = config.colocated or config.prefill
        self.now_s = 0.0
        admission = admission_config(config.admission, config.admission_config)
        # As router/server.py: `always` needs no gate (nothing to decide, no model to feed).
        self.admission = (
            None
            if admission.policy == "always"
            else SimAdmission(
                admission,
                config.ttft_slo_s,
                config.tpot_slo_s,
                profile.model.kv_bytes_per_token,
                self.block_tokens,
                config.limits.max_num_batched_tokens,
                config.decode or config.colocated,
                colocated=bool(config.colocated),
            )
        )
        self.router = SimRouter(
            config.policy,
            prefill_pool,
            max(config.decode, 1),
            self.block_tokens,
            clock=lambda: self.now_s,
            prefix_pull=config.prefix_pull,
            kv_bytes_per_token=profile.model.kv_bytes_per_token,
            # As router/service.py: with admission on, the planner reads the gate's prefill model.
            prefill_cost=None if self.admission is None else self.admission.gate.prefill_cost,
        )
        self.learns_costs = config.prefix_pull == "auto"  # only the planner's auto mode reads its models
        self.front = [self.new_worker("colocated" if config.colocated else "prefill", i) for i in range(prefill_pool)]
        self.decode = [self.new_worker("decode", i) for i in range(config.decode)]
        self.handoffs = HandOffs(self, prefill_pool, config.decode)
        self.faults = FaultHandler(self)
        self.client_queue: deque[SimSeq] = deque()
        self.active: set[SimSeq] = set()  # sent, not ended (faults find the requests a death touches)
        self.open_streams = 0
        self.router_streams = 0
        self.idle_since_s = 0.0  # when the router last had no request in flight
        self._events: list = []
        self._order = 0

    def new_worker(self, role: str, index: int) -> SimWorker:
        profile, config = self.profile, self.config
        cost = profile.step_cost(config.tp if role != "prefill" else 1)
        scale = {"prefill": self.over.prefill_step_scale, "decode": self.over.decode_step_scale}.get(role, 1.0)
        cost = cost.scaled(scale).plus_step_s(self.over.step_s)
        if role == "prefill" and self.over.prefill_step_s:  # every prefill worker's step computes a prompt
            cost = dataclasses.replace(cost, prefill_step_s=cost.prefill_step_s + self.over.prefill_step_s)
        kv: BlockCounter | PrefixPool
        if role == "decode":
            kv = BlockCounter((config.decode_kv_tokens or profile.kv_capacity_tokens[config.tp]) // self.block_tokens)
        else:
            tokens = config.prefill_kv_tokens or profile.kv_capacity_tokens[config.tp if role == "colocated" else 1]
            kv = PrefixPool(
                tokens // self.block_tokens,
                self.block_tokens,
                config.enable_prefix_caching,
                self.router.on_event(index),
            )
        worker = SimWorker(index, role, cost, config.limits, kv)
        worker.stretch = self.host.stretch_of(role) if self.host is not None else 1.0
        return worker

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        started = time.perf_counter()
        shared = None if self.config.faults else shared_keys(requests)
        # The ring of `prefix_hash` (and `cache_aware`'s tie-break) is keyed on the leading blocks: kept.
        seqs = [
            SimSeq(
                i,
                r.arrival_s,
                r.prompt_tokens,
                r.output_tokens,
                block_hashes(useful_keys(r.block_keys, shared, DEFAULT_PREFIX_BLOCKS)),
                r.prompt_tokens,
            )
            for i, r in enumerate(requests)
        ]
        for seq in seqs:
            self.push(seq.arrival_s, ARRIVE, seq)
        for fault in self.config.faults:
            self.push(fault.time_s, FAULT, fault)
        if self._events:
            self.push(INDEX_LEASE_S / 2, HEARTBEAT, None)
        handlers = (
            self._on_worker,
            self.handoffs.on_done,
            self._on_adopt,
            self._on_enqueue,
            self.faults.on_restart,
            self.faults.on_fault,
            self._on_arrive,
            self.handoffs.on_start,
            self._on_heartbeat,
            self._on_pull_done,
        )
        events = 0
        with _quiet_gc():
            while self._events:
                self.now_s, kind, _, payload, tag = heapq.heappop(self._events)
                handlers[kind](payload, tag)
                events += 1
        return self._result(seqs, events, time.perf_counter() - started)

    def push(self, time_s: float, kind: int, payload, tag=None) -> None:
        self._order += 1
        heapq.heappush(self._events, (time_s, kind, self._order, payload, tag))

    def _on_heartbeat(self, *_) -> None:
        """The index feeder's heartbeats keep live workers' leases; they go on while anything else is due."""
        self.router.heartbeat()
        if self._events:
            self.push(self.now_s + INDEX_LEASE_S / 2, HEARTBEAT, None)

    def restart_later(self, key: tuple[str, int]) -> None:
        self.push(self.now_s + self.config.restart_s, RESTART, key)

    def schedule(self, worker: SimWorker) -> None:
        """Queues the end of the worker's run (and of the runs a shared host's new stretch moved)."""
        moved = [] if self.host is None else self.restretch()
        self._push_ends([worker, *(w for w in moved if w is not worker)])

    def restretch(self) -> list[SimWorker]:
        """The shared host's stretch recounted; the workers whose run's end it moved."""
        assert self.host is not None
        return self.host.update([*self.front, *self.decode], self.now_s, len(self.handoffs.in_progress))

    def handoffs_changed(self) -> None:
        """A counted hand-off started or ended (sim/handoff.py): the runs its cores moved."""
        self._push_ends(self.restretch())

    def _push_ends(self, workers: list[SimWorker]) -> None:
        for each in workers:
            end_s = each.next_time()
            if end_s is not None:
                self.push(end_s, WORKER, each, each.version)

    # ---- client and router ------------------------------------------------------------------------
    def _on_arrive(self, seq: SimSeq, _) -> None:
        cap = self.config.max_concurrency
        if cap is not None and self.open_streams >= cap:
            self.client_queue.append(seq)
        else:
            self._send(seq)

    def _send(self, seq: SimSeq) -> None:
        seq.send_s = self.now_s
        self.open_streams += 1
        if self.router_streams >= self.config.routers * self.config.router_max_requests:
            self.refuse(seq, "concurrency")
            return
        choice = self._choose(seq)  # as the router: the route first, then admission on it
        refusal = self._admit(seq, choice)
        if refusal is not None:
            self.refuse(seq, refusal)
            return
        if self.router_streams == 0:
            seq.wake_s = self.over.wake_s(self.now_s - self.idle_since_s)
        self.router_streams += 1
        self.active.add(seq)
        self._book(seq, choice)

    def refuse(self, seq: SimSeq, cause: str) -> None:
        seq.refusal = cause
        self.end(seq, "rejected")

    def _choose(self, seq: SimSeq) -> PrefillChoice | None:
        return self.router.choose_prefill(seq.keys, seq.prompt, b"sim-request-%d" % seq.index)

    def _admit(self, seq: SimSeq, choice: PrefillChoice | None) -> str | None:
        """The admission policy's cause when it refuses the request on its route, else None. Without a
        worker to route to the router decides nothing yet: the request waits for one (sim/faults.py)."""
        if self.admission is None or choice is None:
            return None
        decode = self.router.choose_decode() if self.decode else choice.worker  # colocated: the worker itself
        if decode is None:
            return None
        instance = self.decode[decode] if self.decode else self.front[decode]
        load = self.router.load(choice.worker)
        decision = self.admission.decide(seq, choice.uncached, load, decode, instance, self.now_s)
        return None if decision.admit else str(decision.cause)

    def route(self, seq: SimSeq) -> None:
        """Books the request on a prefill worker (and decode instance) and queues it there."""
        self._book(seq, self._choose(seq))

    def _book(self, seq: SimSeq, choice: PrefillChoice | None) -> None:
        decode = self.router.choose_decode() if self.decode else 0
        if choice is None or decode is None:
            self.faults.wait_for_workers(seq)
            return
        seq.prefill_worker, seq.estimate_tokens, seq.pull = choice
        self.router.book(seq.prefill_worker, seq.estimate_tokens)
        seq.booked = True
        if self.decode:
            seq.decode_worker = decode
            self.router.decode_inflight.add(decode, 1)
        if self.admission is not None:
            self.admission.routed(seq)
        seq.stage = "routing"
        wake_s = seq.wake_s if seq.migrations == 0 else 0.0
        route_s = max(self.over.route_s + self.over.jitter_s(self.over.route_jitter_s, seq.index), 0.0)
        self.push(self.now_s + route_s + wake_s, ENQUEUE, seq, seq.migrations)

    def _on_enqueue(self, seq: SimSeq, attempt: int) -> None:
        if attempt != seq.migrations:
            return
        seq.stage = "prefill"
        worker = self.front[seq.prefill_worker]
        seq.pull_ready_s = 0.0
        if seq.pull is not None:
            self._start_pull(seq, worker)
        if worker.submit(seq, self.now_s):
            self.schedule(worker)

    def _start_pull(self, seq: SimSeq, worker: SimWorker) -> None:
        """The worker pulls the prefix the router asked for from its holder (a dead holder sends nothing)."""
        assert seq.pull is not None
        holder = self.front[self.router.index_of[seq.pull.holder_id]]
        pulled = 0 if self.faults.is_dead(holder) else worker.pull_prefix(seq, holder, seq.pull.num_blocks)
        if not pulled:
            return
        num_bytes = pulled * self.block_tokens * self.profile.model.kv_bytes_per_token
        transfer_s = self.profile.transfer.seconds(num_bytes)
        seq.pull_ready_s = self.now_s + transfer_s
        if seq.migrations == 0:
            seq.pulled = pulled * self.block_tokens
        self.push(seq.pull_ready_s, PULL_DONE, seq, (seq.migrations, PullOutcome(pulled, num_bytes, transfer_s)))

    def _on_pull_done(self, seq: SimSeq, tag: tuple[int, PullOutcome]) -> None:
        attempt, outcome = tag
        if attempt != seq.migrations:  # its worker died meanwhile: the request was routed again
            return
        self.router.planner.observe_pull(outcome)  # as the router learns it, with the first token's reply
        worker = self.front[seq.prefill_worker]
        if worker.pull_done(self.now_s):
            self.schedule(worker)

    def finish(self, seq: SimSeq) -> None:
        """Its last token reached the client now."""
        seq.last_token_s = self.now_s + (self.over.token_s if seq.emitted > 1 else self.over.first_token_s)
        self.end(seq, "ok")

    def end(self, seq: SimSeq, status: str) -> None:
        if status != "rejected":
            self.router_streams -= 1
            if self.router_streams == 0:
                self.idle_since_s = self.now_s
            self.active.discard(seq)
            self.release(seq)
            if seq.decode_worker >= 0 and self.decode:
                self.router.decode_inflight.add(seq.decode_worker, -1)
        seq.status, seq.stage = status, "done"
        self.open_streams -= 1
        if self.client_queue:
            self._send(self.client_queue.popleft())

    def release(self, seq: SimSeq) -> None:
        """Ends the request's booking on its prefill worker (its end, or a migration)."""
        if self.admission is not None:
            self.admission.left(seq)
        if seq.booked:
            self.router.release(seq.prefill_worker, seq.estimate_tokens)
            seq.booked, seq.estimate_tokens = False, 0

    # ---- workers ----------------------------------------------------------------------------------
    def _on_worker(self, worker: SimWorker, version: int) -> None:
        if version != worker.version or self.faults.is_dead(worker):
            return
        run = worker.run
        if self.admission is not None and run is not None:  # the steps the worker reports
            self.admission.observe_run(worker, run, worker.context_tokens)
        elif self.learns_costs and run is not None and run.chunks and not run.batch and worker.role != "decode":
            # The prefill model learns the steps the worker reports (pure prefill steps, as a prefill worker's).
            tokens = sum(new for _, new in run.chunks)
            self.router.planner.prefill_cost.observe(PrefillStep(tokens, (run.end_s() - run.start_s) / run.steps))
        completed, finished = worker.finish_run()
        for seq in completed:
            self._first_token(worker, seq)
        for seq in finished:
            self._finished(worker, seq)
        worker.plan(self.now_s)
        self.schedule(worker)

    def _first_token(self, worker: SimWorker, seq: SimSeq) -> None:
        seq.emitted += 1
        if seq.first_token_s is None:
            seq.first_token_s = self.now_s + self.over.first_token_s
        self.router.first_token(seq.prefill_worker, seq.estimate_tokens)
        seq.estimate_tokens = 0
        if seq.decode_left == 0:  # done at prefill: nothing is handed off
            worker.release_prefill(seq)
            self.finish(seq)
        elif worker.role == "colocated":
            seq.stage = "decode"
            worker.start_decoding(seq)
        elif self.faults.decode_dead(seq):  # its hand-off fails: the request migrates
            worker.release_prefill(seq)
            self.faults.migrate(seq, seq.emitted)
        else:
            self.handoffs.pin(seq)

    def _on_adopt(self, seq: SimSeq, attempt: int) -> None:
        self.handoffs.over(seq, attempt)
        if attempt != seq.migrations:
            return
        seq.stage = "decode"
        instance = self.decode[seq.decode_worker]
        if instance.adopt(seq, self.now_s):
            self.schedule(instance)

    def _finished(self, worker: SimWorker, seq: SimSeq) -> None:
        if worker.role == "decode":
            worker.release_decode(seq)
            self.handoffs.reserve_next(worker.index)
        else:
            worker.release_prefill(seq)
        self.finish(seq)

    def _result(self, seqs: list[SimSeq], events: int, wall_s: float) -> SimResult:
        records = [s.record() for s in seqs]
        busy = {"prefill": sum(w.busy_s for w in self.front), "decode": sum(w.busy_s for w in self.decode)}
        steps = {"prefill": sum(w.steps_done for w in self.front), "decode": sum(w.steps_done for w in self.decode)}
        return SimResult(
            self.config.name,
            self.config.ttft_slo_s,
            self.config.tpot_slo_s,
            records,
            self.config.workers,
            events,
            wall_s,
            busy,
            self.handoffs.seconds,
            steps,
        )


@contextlib.contextmanager
def _quiet_gc() -> Iterator[None]:
    """The garbage collector kept off the fleet's own state while the loop runs.

    A large fleet holds millions of long-lived objects (block pools, caches, sequences); every full
    collection walks them all, and the loop's allocations trigger collections often, so collecting
    cost about a third of a 2,000-worker run (profiled). The state built so far is frozen (never
    scanned) and young collections run less often; cycles made during the run are still collected.
    """
    gc.freeze()  # a list splice, as is unfreeze: free for the many small runs a plan search makes
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], YOUNG_GC_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
