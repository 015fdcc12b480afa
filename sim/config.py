"""`SimConfig`: the cluster one simulation runs, validated once here (errors name the key).

Pools mirror `ClusterConfig` (common/config.py): `prefill` workers and `decode` instances of `tp`
ranks each, or `colocated` workers doing both (the baseline disaggregation is compared against), and
each worker's engine limits. The router part mirrors `router.*` and the bench's client: the routing
policy (a name of the router's policy registry, `policies.routing.make_policy`, whose objects the
simulator runs), prefix pulls between prefill workers (`router.prefix_pull`'s modes, decided by the
router's own `policies.prefix_pull.PullPlanner`), admission (a name of `policies.admission`'s registry
and its `AdmissionConfig`, run through the router's own `AdmissionGate`: sim/admission.py), the
router's concurrency limit, the client's concurrency cap, and the SLO every request carries and is
judged against (as `splitserve bench --ttft-ms/--tpot-ms` sends it). `host_cores` says the workers
share one host's CPU cores (a test cluster on one machine, sim/contention.py); by default every worker
has its own accelerator, as in a real fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.admission_config import ADMISSION_POLICIES, AdmissionConfig
from policies.prefix_pull import MODES as PREFIX_PULL_MODES
from sim.worker import EngineLimits

POLICIES = ("cache_aware", "round_robin", "least_loaded", "prefix_hash")  # policies.routing registry names
ADMISSIONS = ADMISSION_POLICIES  # policies.admission registry names


@dataclass(frozen=True)
class Fault:
    """At `time_s` the worker `index` of pool `role` dies: its requests migrate; a replacement serves
    `restart_s` later with an empty cache (as the controller replaces a dead worker)."""

    time_s: float
    role: str
    index: int = 0


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 1
    decode: int = 1
    tp: int = 1
    colocated: int = 0  # > 0: colocated workers only (prefill and decode must then be 0)
    limits: EngineLimits = EngineLimits()
    prefill_kv_tokens: int | None = None  # KV tokens per prefill / colocated worker; None: the profile's
    decode_kv_tokens: int | None = None  # per decode instance; None: the profile's for its tp
    cache_block_tokens: int | None = None  # prefix-cache granularity; None: the model's block size
    enable_prefix_caching: bool = True
    policy: str = "cache_aware"
    # Pulls of a cached prefix from a worker holding more of it (auto, always, never); the KV moves at
    # the profile's `transfer` rate. Off by default, where the router defaults to auto: a plan's
    # figures then never count on pulls.
    prefix_pull: str = "never"
    admission: str = "always"
    # The admission policy's settings; None: `AdmissionConfig(policy=admission)`. Its policy is `admission`.
    admission_config: AdmissionConfig | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    max_concurrency: int | None = None  # the client's open streams at most (bench --max-concurrency)
    router_max_requests: int = 1024  # router.max_concurrent_requests: beyond it requests are refused
    # Router processes sharing the traffic (stateless peers behind one load balancer): the cluster refuses
    # beyond routers x router_max_requests requests in flight (an even spread; one router's CPU is not modelled).
    routers: int = 1
    migration_limit: int = 3
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    restart_s: float = 5.0
    # Workers sharing one host's CPU cores (sim/contention.py); None: each on its own accelerator.
    host_cores: int | None = None
    host_background_cores: float = 0.0  # processes busy on that host whatever the load, in cores
    host_stream_cpu_per_step_s: float = 0.0  # host CPU outside the engines per decode step (outbox, poll)
    host_stream_cpu_per_token_s: float = 0.0  # and per output token (router relaying it, client reading it)
    host_stream_interference: float = 1.0  # >= 1: streaming's wake-ups slow the engines beyond their CPU
    host_prefill_interference: float = 1.0  # >= 1: and the prefill engines' long steps by this much more
    host_handoff_cores: float = 0.0  # cores a hand-off keeps busy from its transfer's start to its adoption

    def __post_init__(self):
        _check(self.colocated >= 0, "colocated", "must be >= 0")
        if self.colocated:
            _check(self.prefill == 0 and self.decode == 0, "colocated", "excludes prefill and decode workers")
        else:
            _check(self.prefill >= 1, "prefill", "must be >= 1 (or set colocated)")
            _check(self.decode >= 1, "decode", "must be >= 1 (or set colocated)")
        _check(self.tp in (1, 2, 4, 8), "tp", "must be 1, 2, 4 or 8")
        for key in ("prefill_kv_tokens", "decode_kv_tokens", "cache_block_tokens", "max_concurrency"):
            value = getattr(self, key)
            _check(value is None or value >= 1, key, "must be None or >= 1")
        for key in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_tokens"):
            _check(getattr(self.limits, key) >= 1, f"limits.{key}", "must be >= 1")
        _check(self.policy in POLICIES, "policy", f"must be one of {list(POLICIES)}")
        _check(self.prefix_pull in PREFIX_PULL_MODES, "prefix_pull", f"must be one of {list(PREFIX_PULL_MODES)}")
        _check(self.admission in ADMISSIONS, "admission", f"must be one of {list(ADMISSIONS)}")
        for key in ("ttft_slo_s", "tpot_slo_s"):
            value = getattr(self, key)
            _check(value is None or (value > 0 and math.isfinite(value)), key, "must be None or a number > 0")
        _check(
            self.admission_config is None or self.admission_config.policy == self.admission,
            "admission_config",
            f"its policy must be admission ({self.admission!r})",
        )
        _check(self.router_max_requests >= 1, "router_max_requests", "must be >= 1")
        _check(self.routers >= 1, "routers", "must be >= 1")
        _check(self.migration_limit >= 0, "migration_limit", "must be >= 0")
        _check(self.restart_s >= 0, "restart_s", "must be >= 0")
        _check(self.host_cores is None or self.host_cores >= 1, "host_cores", "must be None or >= 1")
        _check(
            self.host_background_cores >= 0 and math.isfinite(self.host_background_cores),
            "host_background_cores",
            "must be a number >= 0",
        )
        for key in ("host_stream_cpu_per_step_s", "host_stream_cpu_per_token_s", "host_handoff_cores"):
            _check(getattr(self, key) >= 0 and math.isfinite(getattr(self, key)), key, "must be a number >= 0")
        for key in (
            "host_background_cores",
            "host_stream_cpu_per_step_s",
            "host_stream_cpu_per_token_s",
            "host_handoff_cores",
        ):
            _check(self.host_cores is not None or not getattr(self, key), key, "needs host_cores")
        for key in ("host_stream_interference", "host_prefill_interference"):
            interference = getattr(self, key)
            _check(interference >= 1 and math.isfinite(interference), key, "must be a number >= 1")
            _check(self.host_cores is not None or interference == 1, key, "needs host_cores")
        for fault in self.faults:
            pool = self.colocated if fault.role == "colocated" else getattr(self, fault.role, 0)
            _check(
                fault.role in ("prefill", "decode", "colocated") and 0 <= fault.index < pool,
                "faults",
                f"{fault} names no worker of this cluster",
            )

    @property
    def workers(self) -> int:
        """Accelerators (or cores) the cluster uses: a decode instance counts its tp ranks."""
        return self.colocated * self.tp if self.colocated else self.prefill + self.decode * self.tp

    @property
    def name(self) -> str:
        if self.colocated:
            return f"{self.colocated}C" + (f" tp{self.tp}" if self.tp > 1 else "")
        return f"{self.prefill}P{self.decode}D" + (f" tp{self.tp}" if self.tp > 1 else "")


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{key}: {message}")
