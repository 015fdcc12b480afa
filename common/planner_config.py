"""`planner:` in the cluster config: the online planner's settings (plain data, no simulator import).

The planner (cluster/planner.py, run by the controller: cluster/planner_loop.py) is off by default.
Enabled, it needs a hardware profile written by `splitserve profile` for the cluster's model and
machines; every `interval_s` it sizes the pools for the SLO (`ttft_ms`, `tpot_ms`, met by
`attainment` of the requests) within `max_workers`. On Kubernetes, `raycluster_name` (the chart
sets it) makes it also patch the RayCluster's worker groups, so pods come and go with the pools.
Errors name the key; `ClusterConfig.from_dict` prefixes the section (`planner.interval_s: ...`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerConfig:
    enabled: bool = False
    profile_path: str | None = None  # a `splitserve profile` JSON; required when enabled
    interval_s: float = 30.0  # one decision per interval
    cooldown_s: float = 120.0  # after a change, none for this long (new workers warm up, drained ones finish)
    report_interval_s: float = 5.0  # each router sends its traffic counters to the controller this often
    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0
    attainment: float = 0.9
    max_workers: int = 16  # prefill workers + decode instances, at most
    scale_down_headroom: float = 1.2  # a shrink must hold at this multiple of the observed rate
    scale_down_intervals: int = 2  # consecutive intervals agreeing on a shrink
    window_requests: int = 400  # synthetic requests per simulated decision
    raycluster_name: str | None = None  # Kubernetes: the RayCluster whose worker groups follow the pools
    raycluster_namespace: str | None = None  # its namespace; None: the pod's own (service account)

    def __post_init__(self):
        for key in ("interval_s", "cooldown_s", "report_interval_s", "ttft_ms", "tpot_ms"):
            _check(getattr(self, key) > 0, key, "must be > 0")
        _check(
            self.report_interval_s <= self.interval_s,
            "report_interval_s",
            "must be <= interval_s (every decision needs fresh reports)",
        )
        _check(0 < self.attainment <= 1, "attainment", "must be in (0, 1]")
        _check(self.max_workers >= 2, "max_workers", "must be >= 2 (one prefill, one decode)")
        _check(self.scale_down_headroom >= 1, "scale_down_headroom", "must be >= 1")
        _check(self.scale_down_intervals >= 1, "scale_down_intervals", "must be >= 1")
        _check(self.window_requests >= 10, "window_requests", "must be >= 10")
        _check(not self.enabled or bool(self.profile_path), "profile_path", "required when planner.enabled")
        _check(
            self.raycluster_name is None or bool(self.raycluster_name),
            "raycluster_name",
            "must be None or a RayCluster's name",
        )


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{key}: {message}")
