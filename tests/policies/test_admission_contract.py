"""The admission-policy contract (policies/admission/base.py), run against every registered policy."""
from __future__ import annotations

import math
import random

import pytest

from policies.admission import (ADMISSION_POLICIES, POLICIES, AdmissionConfig, AdmissionDecision, Cause,
                              make_admission_policy, policy_from_config)
from policies.admission.cost_model import (DECODE_PRIOR, OBSERVED_TTFT_PRIOR, PREFILL_PRIOR, TRANSFER_PRIOR, DecodeStepFit,
                                         ObservedTtftFit, PrefillTimeFit)
from policies.admission.view import AdmissionRequest, ClusterView, DecodeInstanceView, RunningRequest
from policies.routing.base import WorkerLoad

CONFIG = AdmissionConfig(full_budget_priority=2, shed_step_per_priority=0.3, default_ttft_ms=1000,
                         default_tpot_ms=100, max_queued_prompt_tokens=20_000, max_running_requests=64)


def idle_view() -> ClusterView:
    return ClusterView((WorkerLoad("p0", 0, 0), WorkerLoad("p1", 0, 0)),
                       (DecodeInstanceView("d0", (), 1000, 1000),), PREFILL_PRIOR, DECODE_PRIOR, TRANSFER_PRIOR,
                       kv_bytes_per_token=131072, block_size_tokens=16, prefill_step_budget_tokens=2048)


def random_request(rng: random.Random) -> AdmissionRequest:
    prompt = rng.choice([1, 7, 300, 4000, 30_000])
    slo = lambda: rng.choice([None, 1e-3, 50.0, 1e6])  # noqa: E731 - a tiny local generator
    return AdmissionRequest(prompt, rng.randint(0, prompt), rng.choice([1, 16, 4096]), slo(), slo(),
                            rng.randint(-5, 5))


def random_view(rng: random.Random) -> ClusterView:
    workers = tuple(WorkerLoad(f"p{i}", rng.randint(0, 50), rng.choice([0, 1, 999, 10**6]))
                    for i in range(rng.randint(0, 3)))
    instances = []
    for i in range(rng.randint(0, 3)):
        running = tuple(RunningRequest(g, g + rng.randint(-3, 300), rng.randint(0, 9000))
                        for g in (rng.randint(0, 500) for _ in range(rng.randint(0, 80))))
        total = rng.choice([1, 64, 10_000])
        instances.append(DecodeInstanceView(f"d{i}", running, rng.randint(0, total), total))
    prefill = rng.choice([PREFILL_PRIOR, PrefillTimeFit(0.0, 0.0, 0.0), PrefillTimeFit(0.5, 1e-3, 1e-7)])
    decode = rng.choice([DECODE_PRIOR, DecodeStepFit(0.0, 0.0, 0.0), DecodeStepFit(0.2, 0.05, 1e-5)])
    observed = rng.choice([OBSERVED_TTFT_PRIOR, ObservedTtftFit(0.05, 0.0), ObservedTtftFit(0.03, 1e-4)])
    return ClusterView(workers, tuple(instances), prefill, decode, TRANSFER_PRIOR, rng.choice([0, 4096, 10**6]),
                       rng.choice([1, 16]), rng.choice([1, 512, 8192]), observed)


def assert_well_formed(decision: AdmissionDecision) -> None:
    assert isinstance(decision, AdmissionDecision)
    if decision.admit:
        assert decision.retry_after_s is None and decision.cause is Cause.ADMITTED
    else:
        assert decision.reason and decision.cause is not Cause.ADMITTED
        assert decision.retry_after_s is None or (math.isfinite(decision.retry_after_s)
                                                  and decision.retry_after_s > 0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_admits_an_easy_request_on_an_idle_cluster(name):
    policy = make_admission_policy(name, config=CONFIG)
    for priority in (-5, 0, 2, 7):
        decision = policy.decide(AdmissionRequest(100, 0, 64, None, None, priority), idle_view())
        assert decision.admit, decision.reason
        assert_well_formed(decision)
    policy.check_integrity()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_deterministic_well_formed_and_never_raises(name):
    rng = random.Random(f"admission-{name}")
    cases = [(random_request(rng), random_view(rng)) for _ in range(300)]
    first, second = make_admission_policy(name, config=CONFIG), make_admission_policy(name, config=CONFIG)
    decisions = [first.decide(r, v) for r, v in cases]
    for decision in decisions:
        assert_well_formed(decision)
    assert decisions == [first.decide(r, v) for r, v in cases]  # same policy, same inputs, same answers
    assert decisions == [second.decide(r, v) for r, v in cases]  # and no hidden state between instances
    if name != "always":
        assert {d.admit for d in decisions} == {True, False}  # the generated views do exercise both outcomes
    first.check_integrity()


def test_registry_lists_the_known_names_and_passes_the_config():
    assert tuple(POLICIES) == ADMISSION_POLICIES  # the config validates names without importing policies
    with pytest.raises(ValueError, match=r"unknown admission policy 'fifo'; known: \['always', 'predictive', "
                                         r"'threshold'\]"):
        make_admission_policy("fifo")
    policy = policy_from_config(AdmissionConfig(policy="threshold", max_running_requests=3))
    assert policy.name == "threshold" and policy.config.max_running_requests == 3
    assert make_admission_policy("always").config == AdmissionConfig()
