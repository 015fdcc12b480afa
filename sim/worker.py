"""One simulated worker: the engine's scheduling rules with modelled step times, advanced in runs.

The rules are the engine's (engine/scheduler.py), with one role each (prefill, decode, colocated):
- a step first gives every decoding sequence one token, then every prefilling sequence (arrival
  order) up to `prefill_chunk_tokens` of its uncomputed prompt, all within `max_num_batched_tokens`;
- while budget is left and fewer than `max_num_seqs` run, waiting sequences are admitted FCFS, each
  starting after its cached prefix (a real `BlockPool` lookup, sim/kv.py); a sequence whose prefix
  pull has not arrived yet is not admitted, nor anything behind it (its start waits for the pull only
  if it did not wait that long in the queue anyway);
- prefill: a sequence whose prompt is computed yields its first token at the end of that step and
  leaves, its blocks pinned until its hand-off releases them; decode: adopted sequences join at the
  next step; colocated: the first token's sequence goes on decoding in the same batch.
Where the simulator departs (so a run never preempts): a sequence's blocks for its whole prompt
(colocated: prompt and output) are taken when it is admitted; decode rows are never cut by the
token budget (in practice far below it).

Runs of identical steps: between two changes of the batch (a sequence admitted, completing its
prompt or its output) every step computes the same chunks, and its time grows by a constant (see
sim/step_cost.py), so a whole run is one event: it ends at t0 + k*d0 + delta*k*(k-1)/2. New
work that could join earlier cuts the run at the first step boundary after it arrives.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from sim.kv import BlockCounter, PrefixPool, blocks_for
from sim.seq import SimSeq
from sim.step_cost import StepCost, prefill_pairs

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_chunk_tokens: int = 512


@dataclass
class Run:
    start_s: float
    first_s: float  # the first step's time
    growth_s: float  # each next step takes this much longer
    steps: int
    chunks: list  # (seq, tokens per step) of the prefilling sequences
    batch: int  # decoding sequences
    cuttable: bool  # new work could join at the next step boundary
    stretch: float = 1.0  # the host's stretch its step times were planned at

    def end_s(self, steps: int | None = None) -> float:
        k = self.steps if steps is None else steps
        return self.start_s + k * self.first_s + self.growth_s * k * (k - 1) / 2

    def boundary_after(self, time_s: float) -> int:
        """The first step boundary (1..steps) at or after `time_s`."""
        elapsed, a, b = time_s - self.start_s, self.growth_s / 2, self.first_s - self.growth_s / 2
        k = elapsed / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * max(elapsed, 0.0))) / (2 * a)
        k = max(1, math.ceil(k - 1e-9))
        while k > 1 and self.end_s(k - 1) >= time_s:
            k -= 1
        while k < self.steps and self.end_s(k) < time_s:
            k += 1
        return min(k, self.steps)


class SimWorker:
    def __init__(self, index: int, role: str, cost: StepCost, limits: EngineLimits, kv):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.index, self.role, self.cost, self.limits, self.kv = index, role, cost, limits, kv
        self.waiting: deque[SimSeq] = deque()
        self.prefilling: list[SimSeq] = []
        self.adopting: list[SimSeq] = []
        self._decoding: list[tuple[int, int, SimSeq]] = []  # heap of (finish step, order, seq)
        self.context_tokens = 0  # KV tokens the decode rows read in the next step
        self.steps_done = 0
        self.run: Run | None = None
        self.version = 0  # bumped whenever the run's end moves (stale scheduled events are skipped)
        self.blocked = False  # the waiting head found no KV room at the last plan
        self.dead = False  # a fault ended it (sim/faults.py)
        self.stretch = 1.0  # steps take this many times their cost (cores shared: sim/contention.py)
        self.busy_s = 0.0
        self.tokens_computed = 0
        self._order = 0

    @property
    def num_decoding(self) -> int:
        return len(self._decoding)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.adopting or self._decoding)

    # ---- inputs -----------------------------------------------------------------------------------
    def submit(self, seq: SimSeq, now_s: float) -> bool:
        """A prompt to prefill; True when the run's end moved (the caller reschedules)."""
        self.waiting.append(seq)
        return self._wake(now_s, self.run is not None and self.run.cuttable)

    def pull_done(self, now_s: float) -> bool:
        """A waiting sequence's pulled prefix arrived: it may be admitted at the next step boundary."""
        return self._wake(now_s, self.run is not None and self.run.cuttable)

    def adopt(self, seq: SimSeq, now_s: float) -> bool:
        """Decode: a sequence whose KV arrived joins at the next step."""
        self.adopting.append(seq)
        return self._wake(now_s, True)

    def kick(self, now_s: float) -> bool:
        """KV was released outside the engine (a hand-off ended): a blocked admission may proceed."""
        return self._wake(now_s, True) if self.blocked or self.run is None else False

    def _wake(self, now_s: float, cut: bool) -> bool:
        if self.run is None:
            self._plan(now_s)
            self.version += 1
            return self.run is not None
        if now_s <= self.run.start_s and (cut or self.role != "decode"):
            # Work arriving at the instant a run starts joins it (nothing of the run is applied yet).
            self.run = None
            self._plan(now_s)
            self.version += 1
            return True
        if cut:
            steps = self.run.boundary_after(now_s)
            if steps < self.run.steps:
                self.run.steps = steps
                self.version += 1
                return True
        return False

    def restretch(self, now_s: float, stretch: float) -> bool:
        """Steps from the next boundary on take `stretch` x their cost; True when the run's end moved."""
        old, self.stretch, run = self.stretch, stretch, self.run
        if run is None or old == stretch:
            return False
        if now_s <= run.start_s:  # nothing of the run has happened yet: it all runs at the new stretch
            run.first_s, run.growth_s = run.first_s * stretch / old, run.growth_s * stretch / old
            run.stretch = stretch
        else:
            steps = run.boundary_after(now_s)
            if steps >= run.steps:
                return False
            run.steps = steps  # the rest is planned again at its end, at the new stretch
        self.version += 1
        return True

    def decode_rates_per_s(self) -> tuple[float, float]:
        """(decode steps, output tokens) per second of the current run at its profiled step time;
        (0, 0) when idle, dead or prefilling only: what the host spends streaming scales with them."""
        run = self.run
        if run is None or self.dead or not run.batch:
            return 0.0, 0.0
        steps_per_s = run.stretch / run.first_s
        return steps_per_s, run.batch * steps_per_s

    # ---- advancing --------------------------------------------------------------------------------
    def next_time(self) -> float | None:
        return None if self.run is None else self.run.end_s()

    def finish_run(self) -> tuple[list[SimSeq], list[SimSeq]]:
        """Applies the current run; returns (sequences whose prompt completed, sequences finished).
        The caller plans the next run (`plan`) after handling them."""
        run = self.run
        assert run is not None, "finish_run() ends a run"
        now_s = run.end_s()
        self.run = None
        k = run.steps
        self.busy_s += now_s - run.start_s
        self.tokens_computed += k * (run.batch + sum(new for _, new in run.chunks))
        self.steps_done += k
        self.context_tokens += k * run.batch
        completed = []
        for seq, new in run.chunks:
            seq.computed += k * new
            self._register(seq)
            if seq.computed == seq.prompt:
                completed.append(seq)
        if completed:
            done = set(map(id, completed))
            self.prefilling = [s for s in self.prefilling if id(s) not in done]
        finished = []
        while self._decoding and self._decoding[0][0] <= self.steps_done:
            seq = heapq.heappop(self._decoding)[2]
            self.context_tokens -= seq.join_tokens + self.steps_done - seq.join_step
            seq.emitted = seq.output
            finished.append(seq)
        return completed, finished

    def emitted_by(self, seq: SimSeq, time_s: float) -> int:
        """Output tokens a decoding sequence has produced by `time_s` (migration after a fault)."""
        steps = self.steps_done
        if self.run is not None and self.run.batch and time_s > self.run.start_s:
            k = self.run.boundary_after(time_s)
            steps += k if self.run.end_s(k) <= time_s else k - 1
        return min(seq.emitted + max(steps - seq.join_step, 0), seq.output)

    def start_decoding(self, seq: SimSeq) -> None:
        """The sequence (prompt computed, first token out) decodes its remaining tokens in this batch."""
        seq.join_step, seq.join_tokens = self.steps_done, seq.prompt + 1
        seq.finish_step = self.steps_done + seq.decode_left
        self.context_tokens += seq.join_tokens
        self._order += 1
        heapq.heappush(self._decoding, (seq.finish_step, self._order, seq))

    def plan(self, now_s: float) -> None:
        """Starts the next run at `now_s` if there is work that can run."""
        if self.run is None:
            self._plan(now_s)
            self.version += 1

    def _plan(self, now_s: float) -> None:
        for seq in self.adopting:
            self.start_decoding(seq)
        self.adopting.clear()
        limits, batch = self.limits, len(self._decoding)
        budget = limits.max_num_batched_tokens - batch
        chunks = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            new = min(seq.prompt - seq.computed, limits.prefill_chunk_tokens, budget)
            chunks.append((seq, new))
            budget -= new
        running = len(self.prefilling) + batch
        self.blocked = pulling = False
        while self.waiting and budget > 0 and running < limits.max_num_seqs:
            seq = self.waiting[0]
            if seq.pull_ready_s > now_s:  # its pull's end cuts the run (`pull_done`) to admit it
                pulling = True
                break
            if not self._admit(seq):
                self.blocked = True
                break
            self.waiting.popleft()
            self.prefilling.append(seq)
            running += 1
            new = min(seq.prompt - seq.computed, limits.prefill_chunk_tokens, budget)
            chunks.append((seq, new))
            budget -= new
        if not chunks and not batch:
            return
        self.run = self._run(
            now_s,
            chunks,
            batch,
            cuttable=self.role == "decode"
            or ((not self.waiting or pulling) and budget > 0 and running < limits.max_num_seqs),
        )

    def _run(self, now_s: float, chunks: list, batch: int, cuttable: bool) -> Run:
        cost = self.cost
        tokens = batch + sum(new for _, new in chunks)
        pairs = sum(prefill_pairs(seq.computed, new) for seq, new in chunks)
        first_s = self.stretch * cost.seconds(tokens, batch + len(chunks), pairs, self.context_tokens)
        growth_s = self.stretch * (
            cost.prefill_pair_s * sum(new * new for _, new in chunks) + cost.decode_context_s * batch
        )
        steps = [(seq.prompt - seq.computed) // new for seq, new in chunks]
        if batch:
            steps.append(self._decoding[0][0] - self.steps_done)
        return Run(now_s, first_s, growth_s, min(steps), chunks, batch, cuttable, self.stretch)

    # ---- KV ---------------------------------------------------------------------------------------
    def _admit(self, seq: SimSeq) -> bool:
        pool: PrefixPool = self.kv
        hits = pool.match(seq.keys, seq.prompt) if seq.computed == 0 else []
        total = blocks_for(seq.prompt + (seq.decode_left if self.role == "colocated" else 0), pool.block_tokens)
        if not pool.can_take(hits, total):
            return False
        seq.table = pool.take(hits, total)
        if seq.pull_table:  # the sequence holds its pulled prefix itself now
            pool.release(seq.pull_table)
            seq.pull_table = []
        seq.registered = len(hits)
        seq.computed = len(hits) * pool.block_tokens
        if seq.migrations == 0:
            seq.cached = seq.computed
        return True

    def pull_prefix(self, seq: SimSeq, holder: SimWorker, num_blocks: int) -> int:
        """A prefix pull from `holder` as the sequence arrives here: the blocks it copied (0: none)."""
        pool: PrefixPool = self.kv
        seq.pull_table, pulled = pool.pull(holder.kv, seq.keys[:num_blocks], seq.prompt)
        return pulled

    def drop_pull(self, seq: SimSeq) -> None:
        """The sequence left before it was admitted (a fault): its pulled prefix is no longer pinned."""
        if seq.pull_table:
            self.kv.release(seq.pull_table)
            seq.pull_table = []

    def _register(self, seq: SimSeq) -> None:
        full = seq.computed // self.kv.block_tokens
        if full > seq.registered:
            self.kv.mark(seq.table, seq.keys, seq.registered, full)
            seq.registered = full

    def release_prefill(self, seq: SimSeq) -> None:
        """The sequence's pinned blocks go back to the pool (they stay cached until evicted)."""
        self.kv.release(seq.table)
        seq.table = []

    def reserve(self, seq: SimSeq, block_tokens: int) -> bool:
        """Decode: blocks for the whole context the sequence will have; False when they do not fit."""
        counter: BlockCounter = self.kv
        blocks = blocks_for(seq.prompt + seq.decode_left, block_tokens)
        if not counter.can_take(blocks):
            return False
        counter.take(blocks)
        seq.decode_blocks = blocks
        return True

    def release_decode(self, seq: SimSeq) -> None:
        self.kv.release(seq.decode_blocks)
        seq.decode_blocks = 0
