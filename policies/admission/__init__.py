"""Admission control: admit or reject each request early, by name (docs/architecture.md, "Routing and admission").

A registry: `make_admission_policy(name, config=...)`; unknown names fail listing the known ones.
The pieces, one concept per module: `common/admission_config.py` (settings, SLO defaults, the shedding
rule), `step_stats` (what workers report, and the router's own TTFT samples), `linear_fit` + `cost_model` (online
step-time and observed-TTFT models), `view` (the request and cluster snapshot a decision reads),
`decode_projection` + `predictor` (predicted TTFT / TPOT), `base` (the policy contract), `policies`
(always, threshold) and `predictive`.
"""

from __future__ import annotations

from common.admission_config import ADMISSION_POLICIES, AdmissionConfig, PrioritySlo, Slo
from policies.admission.base import AdmissionDecision, AdmissionPolicy, Cause
from policies.admission.cost_model import (
    DecodeCostModel,
    DecodeStepFit,
    ObservedTtftFit,
    ObservedTtftModel,
    PrefillCostModel,
    PrefillTimeFit,
    TransferCostModel,
    TransferTimeFit,
)
from policies.admission.policies import AlwaysAdmitPolicy, ThresholdPolicy
from policies.admission.predictive import PredictivePolicy
from policies.admission.predictor import Prediction, predict
from policies.admission.step_stats import DecodeStep, PrefillStep, TransferStep, TtftSample
from policies.admission.view import AdmissionRequest, ClusterView, DecodeInstanceView, RunningRequest

POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (AlwaysAdmitPolicy, ThresholdPolicy, PredictivePolicy)
}


def make_admission_policy(name: str, **kwargs) -> AdmissionPolicy:
    """The policy called `name`; kwargs go to its constructor (today: `config: AdmissionConfig`)."""
    if name not in POLICIES:
        raise ValueError(f"unknown admission policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)


def policy_from_config(config: AdmissionConfig) -> AdmissionPolicy:
    """The policy `config.policy` names, configured by `config`."""
    return make_admission_policy(config.policy, config=config)


__all__ = [
    "ADMISSION_POLICIES",
    "POLICIES",
    "AdmissionConfig",
    "AdmissionDecision",
    "AdmissionPolicy",
    "AdmissionRequest",
    "AlwaysAdmitPolicy",
    "Cause",
    "ClusterView",
    "DecodeCostModel",
    "DecodeInstanceView",
    "DecodeStep",
    "DecodeStepFit",
    "ObservedTtftFit",
    "ObservedTtftModel",
    "Prediction",
    "PredictivePolicy",
    "PrefillCostModel",
    "PrefillStep",
    "PrefillTimeFit",
    "PrioritySlo",
    "RunningRequest",
    "Slo",
    "ThresholdPolicy",
    "TransferCostModel",
    "TransferStep",
    "TransferTimeFit",
    "TtftSample",
    "make_admission_policy",
    "policy_from_config",
    "predict",
]
