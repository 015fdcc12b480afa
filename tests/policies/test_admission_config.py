"""AdmissionConfig: validation naming the key, the plain-data loader, SLO defaults and the shedding rule."""
from __future__ import annotations

import dataclasses

import pytest

from policies.admission import AdmissionConfig, PrioritySlo, Slo


def test_defaults_are_valid_and_admission_is_off():
    config = AdmissionConfig()
    assert config.policy == "always"
    assert config.slo_for(0) == Slo(2000.0, 200.0)
    assert config.headroom(0) == 1.0


@pytest.mark.parametrize("key, value", [
    ("policy", "random"), ("default_ttft_ms", 0), ("default_tpot_ms", float("nan")), ("slo_margin", 1.5),
    ("slo_margin", 0), ("min_headroom", 0), ("shed_step_per_priority", 1.0), ("shed_step_per_priority", -0.1),
    ("full_budget_priority", 1.5), ("max_queued_prompt_tokens", 0), ("max_running_requests", True),
    ("max_kv_usage", 1.01), ("retry_after_s", -1), ("min_retry_after_s", float("inf")),
    ("cost_window_steps", 0), ("cost_min_samples", 0),
])
def test_bad_values_fail_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"^admission\.{key}: "):
        AdmissionConfig(**{key: value})


def test_cross_field_rule_min_samples_within_window():
    with pytest.raises(ValueError, match=r"admission\.cost_min_samples: must be <= cost_window_steps \(16\)"):
        AdmissionConfig(cost_window_steps=16, cost_min_samples=17)


def test_priority_slos_from_plain_data():
    config = AdmissionConfig.from_dict({"policy": "predictive", "priority_slos": {
        "2": {"ttft_ms": 300, "tpot_ms": 50}, -1: {"ttft_ms": 10000, "tpot_ms": 500}}})
    assert config.priority_slos == (PrioritySlo(-1, 10000, 500), PrioritySlo(2, 300, 50))
    assert config.slo_for(2) == Slo(300, 50) and config.slo_for(-1) == Slo(10000, 500)
    assert config.slo_for(1) == Slo(config.default_ttft_ms, config.default_tpot_ms)
    assert dataclasses.asdict(config)["priority_slos"][0] == {"priority": -1, "ttft_ms": 10000, "tpot_ms": 500}


@pytest.mark.parametrize("raw, message", [
    ({"polcy": "always"}, r"unknown key\(s\) \['admission.polcy'\]; known: \[.*'policy'"),
    ({"priority_slos": [1, 2]}, r"admission\.priority_slos: must be a mapping"),
    ({"priority_slos": {"high": {"ttft_ms": 1, "tpot_ms": 1}}}, r"admission\.priority_slos\.high: the key"),
    ({"priority_slos": {1: {"ttft_ms": 1}}}, r"admission\.priority_slos\.1: must be a mapping with exactly"),
    ({"priority_slos": {1: {"ttft_ms": -5, "tpot_ms": 1}}}, r"admission\.priority_slos\.1\.ttft_ms: must be"),
    ({"priority_slos": {1: {"ttft_ms": 5, "tpot_ms": 1}, "1": {"ttft_ms": 5, "tpot_ms": 1}}},
     r"admission\.priority_slos\.1: is listed twice"),
])
def test_bad_plain_data_fails_naming_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        AdmissionConfig.from_dict(raw)


def test_headroom_rule_table():
    config = AdmissionConfig(full_budget_priority=2, shed_step_per_priority=0.25, min_headroom=0.3)
    assert [config.headroom(p) for p in (5, 2, 1, 0, -1, -100)] == [1.0, 1.0, 0.75, 0.5, 0.3, 0.3]
    flat = AdmissionConfig(shed_step_per_priority=0.0)
    assert {flat.headroom(p) for p in (-1000, 0, 1000)} == {1.0}
