"""The router's own admission gate in the simulator (sim/admission.py): `predictive` refuses what an
overload would make miss its SLO and admits on an idle cluster, deciding with cost models fitted from
the simulated workers' steps and hand-offs (the linear test profile, tests/sim/sim_factories.py:
dense(T) = 1 ms + 0.01 ms * T, hand-off 5 ms + 1e-8 s per byte, no overheads)."""
from __future__ import annotations

import pytest

from policies.admission import AdmissionConfig
from policies.admission.cost_model import DECODE_PRIOR, PREFILL_PRIOR, TRANSFER_PRIOR
from sim import SimConfig, SimRequest, Simulation
from tests.sim.sim_factories import linear_profile

approx = lambda v: pytest.approx(v, rel=1e-9, abs=1e-12)  # noqa: E731


def _run(requests):
    config = SimConfig(admission="predictive", ttft_slo_s=0.05, admission_config=AdmissionConfig("predictive"))
    sim = Simulation(config, linear_profile())
    return sim, sim.run(requests)


def test_predictive_refuses_under_overload_and_admits_when_idle():
    # Warm-up: 20 lone requests of 100, 200, 300 tokens, 50 ms apart (each alone: at most dense(300) = 4 ms
    # to its first token; even the cost models' priors, 10 ms + 0.1 ms per token, predict 40 ms <= 45 ms,
    # the TTFT budget: SLO 50 ms x slo_margin 0.9). By 2 s the prefill model has fitted the steps exactly
    # (1 ms + 0.01 ms per token), the observed-TTFT model the same line (TTFTs of 2, 3, 4 ms, no overheads).
    # Then 100 requests of 1000 tokens at one instant on the one prefill worker, each seeing the tokens
    # booked before it: steps of at most 2048 tokens, chunks of 512 per prompt. The 4th sees 4000 tokens
    # through: 2048 + 1952 = dense(2048) + dense(1952) = 21.48 + 20.52 = 42 ms <= 45 ms, admitted; the 5th
    # 5000: 21.48 + 21.48 + dense(904) = 10.04 -> 53 ms > 45 ms, refused for ttft, and so every later one
    # (nothing has been prefilled at that instant). The four admitted prefill together: first tokens at
    # 42 ms. Then one lone request of 300 tokens at 10 s on an idle cluster: admitted, TTFT dense(300) = 4 ms.
    warm = [SimRequest(0.05 * i, 100 * (1 + i % 3), 4) for i in range(20)]
    burst = [SimRequest(2.0, 1000, 4) for _ in range(100)]
    sim, result = _run([*warm, *burst, SimRequest(10.0, 300, 4)])
    assert [r.status for r in result.records] == ["ok"] * 24 + ["rejected"] * 96 + ["ok"]
    assert {r.refusal for r in result.records if r.status == "rejected"} == {"ttft"}
    assert [r.ttft_s for r in result.records[20:24]] == [approx(0.042)] * 4
    assert result.records[120].ttft_s == approx(0.004)

    gate = sim.admission.gate
    # The models left their priors, fitted from the simulated reports: the prefill steps' exact line,
    # the hand-offs' latency and per-byte time (1000 bytes per token at 1e8 bytes/s).
    assert gate.prefill_cost.fit() != PREFILL_PRIOR
    assert tuple(gate.prefill_cost.fit()) == pytest.approx((0.001, 1e-5, 0.0), abs=1e-9)
    assert gate.transfer_cost.fit() != TRANSFER_PRIOR
    assert tuple(gate.transfer_cost.fit()) == pytest.approx((0.005, 1e-8), rel=1e-6)
    # Decode steps: one sequence each (the hand-offs of the burst, 15 ms each over one sender, never let
    # two overlap on the decode instance), so the fit knows the step of one, dense(1) = 1.01 ms; the
    # per-sequence term is not identifiable and keeps its prior.
    decode = gate.decode_cost.fit()
    assert decode != DECODE_PRIOR and decode.per_request_s == DECODE_PRIOR.per_request_s
    assert decode.step_time_s(1, 500) == approx(0.00101)
    # One TTFT sample per admitted request: 20 + 4 + 1.
    assert gate.ttft_cost.num_samples == 25


def test_always_builds_no_gate():
    sim = Simulation(SimConfig(), linear_profile())
    assert sim.admission is None


def test_a_colocated_worker_is_its_own_decode_instance():
    # max_running_requests = 2, one colocated worker: its streams are the requests routed to it. At t = 0
    # r0 sees none, r1 one, r2 two: refused for running_requests; r3 at 1 s sees none again.
    requests = [SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3), SimRequest(1.0, 100, 3)]
    admission = AdmissionConfig("threshold", max_running_requests=2)
    config = SimConfig(prefill=0, decode=0, colocated=1, admission="threshold", admission_config=admission)
    sim = Simulation(config, linear_profile())
    result = sim.run(requests)
    assert [r.status for r in result.records] == ["ok", "ok", "rejected", "ok"]
    assert result.records[2].refusal == "running_requests"
    # Its steps fed the models by their kind: r3's lone prefill step and decode steps at least.
    assert sim.admission.gate.prefill_cost.num_samples >= 1 and sim.admission.gate.decode_cost.num_samples >= 1
