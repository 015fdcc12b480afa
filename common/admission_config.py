"""Admission settings: frozen plain data, validated once when built; errors name the key.

Meant to become the `admission` section of `common.config.ClusterConfig`; `from_dict` already takes
the YAML / JSON form, where per-priority SLOs are a mapping:

    admission:
      policy: predictive
      priority_slos: {2: {ttft_ms: 300, tpot_ms: 50}, 0: {ttft_ms: 2000, tpot_ms: 200}}

The shedding rule (`headroom`) is documented on `AdmissionConfig.headroom`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple

ADMISSION_POLICIES = ("always", "threshold", "predictive")


class Slo(NamedTuple):
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class PrioritySlo:
    """The SLO a request of `priority` gets when it names none itself."""

    priority: int
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class AdmissionConfig:
    policy: str = "always"  # one of ADMISSION_POLICIES; "always" keeps admission out of the way
    default_ttft_ms: float = 2000.0  # SLO for priorities not listed in priority_slos
    default_tpot_ms: float = 200.0
    priority_slos: tuple[PrioritySlo, ...] = ()
    slo_margin: float = 0.9  # share of an SLO a prediction may use: the rest absorbs model error
    full_budget_priority: int = 0  # priorities at or above this get the whole budget (headroom 1)
    shed_step_per_priority: float = 0.1  # budget share taken away per priority level below it
    min_headroom: float = 0.1  # no priority's budget shrinks below this share
    max_queued_prompt_tokens: int = 32768  # threshold: uncached tokens queued on a prefill worker
    max_running_requests: int = 256  # threshold: sequences on a decode instance
    max_kv_usage: float = 0.95  # threshold: share of a decode instance's KV blocks in use
    retry_after_s: float = 1.0  # suggested wait when no better estimate exists
    min_retry_after_s: float = 0.05  # floor on estimated waits (a retry sooner would see the same load)
    cost_window_steps: int = 256  # step-stat samples each cost model is fitted over
    cost_min_samples: int = 8  # samples before a cost model leaves its prior

    def __post_init__(self):
        _check(self.policy in ADMISSION_POLICIES, "policy", f"must be one of {list(ADMISSION_POLICIES)}")
        for key in ("default_ttft_ms", "default_tpot_ms", "retry_after_s", "min_retry_after_s"):
            _check(_positive(getattr(self, key)), key, "must be a finite number > 0")
        _check(_fraction(self.slo_margin), "slo_margin", "must be in (0, 1]")
        _check(_fraction(self.min_headroom), "min_headroom", "must be in (0, 1]")
        _check(_fraction(self.max_kv_usage), "max_kv_usage", "must be in (0, 1]")
        _check(
            _finite(self.shed_step_per_priority) and 0 <= self.shed_step_per_priority < 1,
            "shed_step_per_priority",
            "must be in [0, 1)",
        )
        _check(_integer(self.full_budget_priority), "full_budget_priority", "must be an integer")
        for key in ("max_queued_prompt_tokens", "max_running_requests", "cost_window_steps", "cost_min_samples"):
            _check(_integer(getattr(self, key)) and getattr(self, key) >= 1, key, "must be an integer >= 1")
        _check(
            self.cost_min_samples <= self.cost_window_steps,
            "cost_min_samples",
            f"must be <= cost_window_steps ({self.cost_window_steps})",
        )
        _check_priority_slos(self.priority_slos)

    def slo_for(self, priority: int) -> Slo:
        """The default SLO of a priority class (a request's own ttft_ms / tpot_ms override it)."""
        for entry in self.priority_slos:
            if entry.priority == priority:
                return Slo(entry.ttft_ms, entry.tpot_ms)
        return Slo(self.default_ttft_ms, self.default_tpot_ms)

    def headroom(self, priority: int) -> float:
        """The share of its budget a request of `priority` may use: lower priorities are shed first.

        headroom(p) = clamp(1 − shed_step_per_priority · (full_budget_priority − p), min_headroom, 1)

        It is the share of the room for *load* a priority gets: `threshold` rejects when the load
        already there reaches limit · headroom; `predictive` when the predicted TTFT / TPOT exceeds
        alone + headroom · (SLO · slo_margin − alone), "alone" being the prediction on an idle cluster.
        Load raises everyone's figures alike, so they cross the smallest allowance first: the lowest
        priority is rejected first, and one at or above `full_budget_priority` only when the whole room
        is gone. An idle cluster admits every priority alike. (Shedding orders requests with the same
        SLO; a class with a tighter SLO is rejected whenever that SLO cannot be met.)
        """
        deficit = max(self.full_budget_priority - priority, 0)
        return max(self.min_headroom, 1.0 - self.shed_step_per_priority * deficit)

    def to_dict(self) -> dict[str, Any]:
        """The plain-data form `from_dict` reads (priority_slos as priority → {ttft_ms, tpot_ms})."""
        raw = dataclasses.asdict(self)
        raw["priority_slos"] = {e.priority: {"ttft_ms": e.ttft_ms, "tpot_ms": e.tpot_ms} for e in self.priority_slos}
        return raw

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AdmissionConfig:
        """From plain data (YAML / JSON); `priority_slos` maps priority → {ttft_ms, tpot_ms}."""
        _check(isinstance(raw, dict), "", "must be a mapping")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        _check(not unknown, "", f"unknown key(s) {['admission.' + k for k in unknown]}; known: {sorted(known)}")
        values = dict(raw)
        if "priority_slos" in values:
            values["priority_slos"] = _parse_priority_slos(values["priority_slos"])
        return cls(**values)


def _parse_priority_slos(raw) -> tuple[PrioritySlo, ...]:
    _check(isinstance(raw, dict), "priority_slos", "must be a mapping of priority → {ttft_ms, tpot_ms}")
    entries = []
    for key, slo in raw.items():
        # JSON object keys are strings; YAML's are ints. Both name a priority.
        priority = int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key
        _check(_integer(priority), f"priority_slos.{key}", "the key must be an integer priority")
        _check(
            isinstance(slo, dict) and set(slo) == {"ttft_ms", "tpot_ms"},
            f"priority_slos.{key}",
            "must be a mapping with exactly ttft_ms and tpot_ms",
        )
        entries.append(PrioritySlo(priority, slo["ttft_ms"], slo["tpot_ms"]))
    return tuple(sorted(entries, key=lambda e: e.priority))


def _check_priority_slos(entries) -> None:
    _check(isinstance(entries, tuple), "priority_slos", "must be a tuple of PrioritySlo")
    seen: set[int] = set()
    for entry in entries:
        _check(isinstance(entry, PrioritySlo), "priority_slos", f"entries must be PrioritySlo, got {entry!r}")
        key = f"priority_slos.{entry.priority}"
        _check(_integer(entry.priority), key, "the priority must be an integer")
        _check(entry.priority not in seen, key, "is listed twice")
        _check(_positive(entry.ttft_ms), f"{key}.ttft_ms", "must be a finite number > 0")
        _check(_positive(entry.tpot_ms), f"{key}.tpot_ms", "must be a finite number > 0")
        seen.add(entry.priority)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value) -> bool:
    return _finite(value) and value > 0


def _fraction(value) -> bool:
    return _finite(value) and 0 < value <= 1


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ValueError(f"admission.{key}: {message}" if key else f"admission: {message}")
