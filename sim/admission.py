"""Admission in a simulation: the router's own `AdmissionGate` (policies/admission/gate.py), fed what the
router feeds it, from the simulated cluster.

- the policy: `SimConfig.admission` names one of `policies.admission`'s (always, threshold,
  predictive), configured by `SimConfig.admission_config` (default: `AdmissionConfig(policy=...)`).
  `always` builds no gate, as the router builds none for it (router/server.py);
- each request carries the SLO `splitserve bench --ttft-ms/--tpot-ms` sends with it: `SimConfig.ttft_slo_s`
  and `tpot_slo_s` as its ttft_ms / tpot_ms, priority 0;
- the cost models learn from what the workers would report: every simulated engine step of a prefill
  worker (`PrefillStep`: tokens computed, duration) and of a decode instance (`DecodeStep`: sequences,
  context tokens read, duration), each finished hand-off (`TransferStep`), and each admitted request's
  TTFT against the uncached tokens queued on its prefill worker when it was admitted (`observe_ttft`,
  at the end of its first attempt, as the router observes it). A run of k identical steps (sim/worker.py)
  is k reports; only its last `cost_window_steps` are fed, the rest would leave the window unread;
- the decision (`decide`), after routing as in router/service.py: the chosen prefill worker's
  `WorkerLoad` (the figures the routing policy saw), the chosen decode instance's streams as the
  router's ledger lists them (every request routed there and not ended, with the tokens streamed so
  far: 0 before its first token), and its free KV blocks as the instance counts them (the gate lowers them
  to what the streams routed there leave, as in the router).
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.admission import (
    AdmissionConfig,
    AdmissionDecision,
    AdmissionRequest,
    DecodeStep,
    PrefillStep,
    RunningRequest,
    TransferStep,
)
from policies.admission.gate import AdmissionGate
from policies.routing import WorkerLoad
from sim.kv import BlockCounter, PrefixPool
from sim.seq import SimSeq
from sim.worker import Run, SimWorker


def admission_config(policy: str, config: AdmissionConfig | None) -> AdmissionConfig:
    return config if config is not None else AdmissionConfig(policy=policy)


class SimAdmission:
    def __init__(
        self,
        config: AdmissionConfig,
        ttft_slo_s: float | None,
        tpot_slo_s: float | None,
        kv_bytes_per_token: int,
        block_tokens: int,
        prefill_step_budget_tokens: int,
        num_decode: int,
        colocated: bool = False,
    ):
        self.gate = AdmissionGate(config, kv_bytes_per_token, block_tokens, prefill_step_budget_tokens)
        self.ttft_ms = None if ttft_slo_s is None else ttft_slo_s * 1e3
        self.tpot_ms = None if tpot_slo_s is None else tpot_slo_s * 1e3
        self.window = config.cost_window_steps
        self.colocated = colocated
        self.on_decode: list[dict[SimSeq, None]] = [{} for _ in range(num_decode)]  # the ledger's streams

    def _instance_of(self, seq: SimSeq) -> int:
        return seq.prefill_worker if self.colocated else seq.decode_worker

    # ---- the ledger's decode streams --------------------------------------------------------------
    def routed(self, seq: SimSeq) -> None:
        self.on_decode[self._instance_of(seq)][seq] = None

    def left(self, seq: SimSeq) -> None:
        """An attempt ended (the request's end, or a migration): its TTFT sample, its stream gone."""
        instance = self._instance_of(seq)
        if instance >= 0:
            self.on_decode[instance].pop(seq, None)
        if seq.tokens_through and seq.first_token_s is not None:
            self.gate.observe_ttft(seq.tokens_through, seq.first_token_s - seq.send_s)
        seq.tokens_through = 0

    # ---- what the workers report --------------------------------------------------------------------
    def observe_run(self, worker: SimWorker, run: Run, context_tokens: int) -> None:
        """The steps of `run`, as the worker reports them; `context_tokens`: its decode rows' KV at its start."""
        if worker.role == "colocated" and run.chunks and run.batch:
            return  # a mixed step fits neither model's shape
        tokens = run.batch + sum(new for _, new in run.chunks)
        seqs = run.batch + len(run.chunks)
        for i in range(max(run.steps - self.window, 0), run.steps):
            duration_s = run.first_s + run.growth_s * i
            if run.chunks:
                self.gate.prefill_cost.observe(PrefillStep(tokens, duration_s))
            else:
                self.gate.decode_cost.observe(DecodeStep(seqs, context_tokens + i * run.batch, duration_s))

    def observe_transfer(self, num_bytes: int, duration_s: float) -> None:
        self.gate.transfer_cost.observe(TransferStep(num_bytes, duration_s))

    # ---- the decision -------------------------------------------------------------------------------
    def decide(
        self, seq: SimSeq, uncached: int, load: WorkerLoad, decode: int, instance: SimWorker, now_s: float
    ) -> AdmissionDecision:
        """`decode`: the chosen decode instance's index, `instance` the instance (colocated: the routed worker)."""
        request = AdmissionRequest(seq.prompt, seq.prompt - uncached, seq.output, self.ttft_ms, self.tpot_ms, 0)
        running = list(self.running(self.on_decode[decode], instance, now_s))
        counter: BlockCounter | PrefixPool = instance.kv
        instance_id = f"{instance.role}-{decode}"
        decision = self.gate.decide_request(
            request, load, instance_id, running, counter.num_free_blocks, counter.num_blocks
        )
        if decision.admit:
            seq.tokens_through = load.queued_prompt_tokens + uncached
        return decision

    @staticmethod
    def running(streams: Iterable[SimSeq], instance: SimWorker, now_s: float) -> Iterable[RunningRequest]:
        adopting = set(map(id, instance.adopting))
        for seq in streams:
            joined = seq.stage == "decode" and id(seq) not in adopting
            generated = instance.emitted_by(seq, now_s) if joined else seq.emitted
            yield RunningRequest(generated, seq.output, seq.prompt_tokens + generated)
