"""The cluster's one configuration: frozen and typed inside, validated once at the edge.

`ClusterConfig.from_dict` is the single loader for every source (CLI flags, a YAML file, the config
the Helm chart renders): unknown keys and bad values fail naming the key. Defaults live here only,
or in the module of their section (`router:` in common/router_config.py, `admission:`, `planner:`);
the checks every section passes, and `ConfigError`, are in common/config_parsing.py. Importers use
`common.config` for all of these: the router section's names and `ConfigError` are re-exported here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from common.admission_config import AdmissionConfig
from common.config_parsing import ConfigError, build, check, reject_unknown
from common.kv_store_config import KVStoreConfig, check_kv_store
from common.planner_config import PlannerConfig
from common.redis_url import parse_redis_url
from common.router_config import PREFIX_PULL_MODES as PREFIX_PULL_MODES
from common.router_config import ROUTING_POLICIES as ROUTING_POLICIES
from common.router_config import RouterConfig, check_router
from engine.config import EngineConfig, EngineLimits, ModelFormat
from engine.layers.quantization import QUANTIZATIONS
from engine.speculative.config import SpeculativeConfig


@dataclass(frozen=True)
class PoolConfig(EngineLimits):
    """One worker pool (prefill or decode): how many, how big, and each worker's engine limits (the engine's
    own keys, `engine.config.EngineLimits`: kv_cache_memory_bytes, num_kv_blocks, max_num_seqs,
    max_num_batched_tokens, prefill_chunk_tokens)."""

    replicas: int = 1
    tp_size: int = 1  # decode: ranks per instance; prefill: must be 1
    num_cpus: float = 1.0  # Ray logical CPUs per actor (per rank)
    num_gpus: float = 0.0  # Ray GPUs per actor (per rank)
    # A Ray custom resource each actor (rank) takes one unit of; pins the pool to the nodes that
    # advertise it (KubeRay: the prefill / decode worker groups). None: any node.
    ray_resource: str | None = None
    threads: int = 1  # torch intra-op threads per actor
    metrics_port: int | None = None  # each actor's Prometheus endpoint; None: off, 0: any free port
    # Weight quantization of this pool's workers; None: the cluster's `quantization`. (Decode steps
    # read every weight per token, prefill is compute-bound: the two may differ.)
    quantization: str | None = None
    # Decode pool only: speculative decoding (engine/speculative/config.py, vLLM's keys); None: off.
    speculative_config: SpeculativeConfig | None = None
    # Mixture-of-experts models under tp_size > 1: split whole experts across the ranks (expert
    # parallelism); false: every rank holds a slice of every expert (engine/layers/fused_moe.py).
    expert_parallel: bool = True
    # MLA models (DeepSeek-V2/V3): decode attends over the latent cache directly, the key and value
    # up-projections folded into the query and the output; false: latents expanded per head, as HF
    # computes it (engine/models/mla.py).
    mla_absorbed_decode: bool = True


@dataclass(frozen=True)
class ControllerConfig:
    """How the controller supervises workers (cluster/controller.py)."""

    health_interval_s: float = 0.5  # every worker rank is pinged this often
    health_timeout_s: float = 5.0  # a ping unanswered this long is a strike (a busy box answers late)
    health_failures: int = 3  # consecutive strikes after which a worker is declared hung and replaced
    drain_quiet_s: float = 2.0  # a draining worker stops after being idle this long (routers have moved on)
    restart_backoff_s: float = 1.0  # first wait before retrying a failed start; doubles up to 30 s


@dataclass(frozen=True)
class ClusterConfig(ModelFormat):
    """The cluster: the engine keys every worker shares (`engine.config.ModelFormat`: dtype, block_size,
    kv_cache_dtype, quantization (a pool may override it), enable_prefix_caching, seed), its pools, and
    the settings of its router, admission, controller and planner."""

    # Which cluster in the Ray cluster (its controller's name). None: a new cluster of its own
    # (the Python API); the command line uses "default".
    cluster_name: str | None = None
    # A checkpoint folder, or a Hub id (ORG/NAME) in the local Hugging Face cache (HF_HOME /
    # HF_HUB_CACHE; never downloaded at start). None: the generated demo checkpoint.
    model_dir: str | None = None
    model_revision: str | None = None  # the Hub id's branch, tag or commit; None: main
    # The names the OpenAI API lists in /v1/models and accepts as `model` (responses carry the first).
    # None: the Hub id, or the checkpoint folder's name and path.
    served_model_name: list[str] | None = None
    max_model_len: int | None = None  # longest sequence (prompt + output) served; None: the model's limit
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    ray_address: str | None = None  # None: start a local Ray cluster
    ray_num_cpus: int | None = None  # logical CPUs of a local Ray cluster (None: enough for the pools)
    # The address workers dial to reach the cluster's rendezvous store (cluster/rendezvous_host.py). The
    # store listens on every interface; this is only what workers are told. None: its node's IP.
    rendezvous_host: str | None = None
    ready_timeout_s: float = 120.0
    handoff_lease_s: float = 30.0  # a reservation/transfer not finished by then is abandoned
    request_timeout_s: float = 600.0  # longest any single request may take end to end
    router: RouterConfig = field(default_factory=RouterConfig)
    # global prefix index: redis://, rediss://, unix://, or a Redis Cluster as redis+cluster://HOST:PORT[,HOST:PORT...];
    # None: the router's in-process index
    redis_url: str | None = None
    index_lease_s: float = 30.0  # a worker's prefix-index entries expire this long after its last heartbeat
    prefix_pull_timeout_s: float = 5.0  # a prefix pull not done by then is abandoned (the prompt is computed)
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)  # KV tiers beyond the pools (kv_store/)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # router admission control
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # the controller's online planner
    # An OpenTelemetry collector's OTLP/gRPC address (http://host:4317) every process exports trace spans
    # to. None: tracing off (no span is made).
    otlp_traces_endpoint: str | None = None

    def __post_init__(self):
        super().__post_init__()
        for name in ("prefill", "decode"):
            _check_pool(name, getattr(self, name))
        check(self.prefill.tp_size == 1, "prefill.tp_size", "prefill workers run with tp_size 1")
        check(
            self.quantization_group_size is None
            or self.quantization != "none"
            or any(pool.quantization not in (None, "none") for pool in (self.prefill, self.decode)),
            "quantization_group_size",
            "needs a weight quantization (int8 or int4) of the cluster or of a pool",
        )
        check(
            self.prefill.speculative_config is None,
            "prefill.speculative_config",
            "speculative decoding runs on the decode pool (prefill samples one token and hands off)",
        )
        check(self.decode.tp_size in (1, 2, 4, 8), "decode.tp_size", "must be 1, 2, 4 or 8")
        check(
            self.served_model_name is None
            or (
                isinstance(self.served_model_name, list | tuple)
                and len(self.served_model_name) > 0
                and all(isinstance(name, str) and name for name in self.served_model_name)
            ),
            "served_model_name",
            "must be None or a non-empty list of non-empty names",
        )
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be None or >= 2")
        check(self.model_revision is None or bool(self.model_revision), "model_revision", "must be None or non-empty")
        check(self.ready_timeout_s > 0, "ready_timeout_s", "must be > 0")
        check(self.handoff_lease_s > 0, "handoff_lease_s", "must be > 0")
        check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        check(self.ray_num_cpus is None or self.ray_num_cpus >= 1, "ray_num_cpus", "must be >= 1")
        check(self.index_lease_s > 0, "index_lease_s", "must be > 0")
        check(self.prefix_pull_timeout_s > 0, "prefix_pull_timeout_s", "must be > 0")
        check(
            self.otlp_traces_endpoint is None or bool(self.otlp_traces_endpoint.strip()),
            "otlp_traces_endpoint",
            "must be None or a collector address such as http://otel-collector:4317",
        )
        check(
            self.rendezvous_host is None or bool(self.rendezvous_host),
            "rendezvous_host",
            "must be None or a non-empty host name or address",
        )
        check(
            self.cluster_name is None or _NAME.fullmatch(self.cluster_name) is not None,
            "cluster_name",
            "must be 1-64 letters, digits, '.', '_' or '-'",
        )
        _check_controller(self.controller)
        if self.redis_url is not None:
            try:
                parse_redis_url(self.redis_url, "redis_url")
            except ValueError as err:  # its message already starts with the key
                raise ConfigError(str(err)) from None
        check_router(self.router)
        check_kv_store(self.kv_store)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClusterConfig:
        """Builds a config from plain data (YAML, JSON, CLI); rejects unknown keys by name."""
        if not isinstance(raw, dict):
            raise ConfigError(f"cluster config must be a mapping, got {type(raw).__name__}")
        reject_unknown(raw, cls, "")
        values = dict(raw)
        for name, section_cls in _SECTIONS.items():
            if name in values:
                section = values[name]
                if not isinstance(section, dict):
                    raise ConfigError(f"{name}: must be a mapping")
                if name in ("prefill", "decode") and "kv_cache_dtype" in section:
                    raise ConfigError(
                        f"{name}.kv_cache_dtype: the KV cache dtype is cluster-wide (top-level "
                        "kv_cache_dtype): prefill and decode pools must store KV alike, since "
                        "blocks move between them as stored"
                    )
                reject_unknown(section, section_cls, f"{name}.")
                values[name] = build(section_cls, _with_speculative(name, section), f"{name}.")
        if "admission" in values:  # its own loader: per-priority SLOs are a nested mapping
            try:
                values["admission"] = AdmissionConfig.from_dict(values["admission"])
            except ValueError as err:
                raise ConfigError(str(err)) from None
        return build(cls, values, "")

    def to_dict(self) -> dict[str, Any]:
        """Plain data that `from_dict` reads back (how workers receive the config)."""
        raw = dataclasses.asdict(self)
        raw["admission"] = self.admission.to_dict()
        return raw

    def engine_config(self, role: str, model_dir: str) -> EngineConfig:
        pool = self.prefill if role == "prefill" else self.decode
        return EngineConfig(
            model_dir=model_dir,
            role=role,
            dtype=self.dtype,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            quantization=pool.quantization or self.quantization,
            # a pool that does not quantize ignores the cluster's grouping (another pool may use it)
            quantization_group_size=self.quantization_group_size
            if (pool.quantization or self.quantization) != "none"
            else None,
            num_kv_blocks=pool.num_kv_blocks,
            kv_cache_memory_bytes=pool.kv_cache_memory_bytes,
            max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            prefill_chunk_tokens=pool.prefill_chunk_tokens,
            # decode instances hash their blocks only to store them (kv_store.write_decode_blocks)
            enable_prefix_caching=self.enable_prefix_caching and (role == "prefill" or self.decode_stores_blocks),
            seed=self.seed,
            num_threads=pool.threads,
            tp_size=pool.tp_size,
            expert_parallel=pool.expert_parallel,
            mla_absorbed_decode=pool.mla_absorbed_decode,
            max_model_len=self.max_model_len,
            speculative_config=pool.speculative_config if role == "decode" else None,
        )

    @property
    def decode_stores_blocks(self) -> bool:
        """Whether decode instances write their sequences' blocks to the shared store as they fill (each
        rank of a TP instance its own KV heads of each block: kv_store/block_shards.py)."""
        return self.kv_store.url is not None and self.kv_store.write_decode_blocks

    @property
    def num_cpus_needed(self) -> float:
        return (
            self.prefill.replicas * self.prefill.num_cpus
            + self.decode.replicas * self.decode.tp_size * self.decode.num_cpus
        )


def _check_pool(name: str, pool: PoolConfig) -> None:
    check(pool.replicas >= 1, f"{name}.replicas", "must be >= 1")
    check(pool.num_cpus > 0, f"{name}.num_cpus", "must be > 0")
    check(pool.num_gpus >= 0, f"{name}.num_gpus", "must be >= 0")
    check(pool.ray_resource is None or bool(pool.ray_resource), f"{name}.ray_resource", "must be None or non-empty")
    check(pool.threads >= 1, f"{name}.threads", "must be >= 1")
    check(
        pool.metrics_port is None or 0 <= pool.metrics_port <= 65535,
        f"{name}.metrics_port",
        "must be None or in [0, 65535]",
    )
    check(
        pool.quantization is None or pool.quantization in QUANTIZATIONS,
        f"{name}.quantization",
        f"must be None or one of {list(QUANTIZATIONS)}",
    )


def _with_speculative(pool_name: str, section: dict) -> dict:
    """A pool section with its `speculative_config` mapping parsed (errors name the full key)."""
    raw = section.get("speculative_config")
    if raw is None or isinstance(raw, SpeculativeConfig):
        return section
    try:
        return {**section, "speculative_config": SpeculativeConfig.from_dict(raw)}
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{pool_name}.{err}") from None


def _check_controller(controller: ControllerConfig) -> None:
    for key in ("health_interval_s", "health_timeout_s", "drain_quiet_s", "restart_backoff_s"):
        check(getattr(controller, key) > 0, f"controller.{key}", "must be > 0")
    check(controller.health_failures >= 1, "controller.health_failures", "must be >= 1")


_SECTIONS = {
    "prefill": PoolConfig,
    "decode": PoolConfig,
    "router": RouterConfig,
    "controller": ControllerConfig,
    "planner": PlannerConfig,
    "kv_store": KVStoreConfig,
}
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
# What a cluster's controller owns: a command joining a running cluster may not ask for other values.
# The rest (router, admission, where Ray is) belongs to each process.
PER_PROCESS_KEYS = frozenset({"router", "admission", "ray_address", "ray_num_cpus", "cluster_name"})


def config_conflicts(given: dict[str, Any], running: dict[str, Any], prefix: str = "") -> list[str]:
    """Where plain-data keys explicitly `given` to a joining command differ from the running cluster's
    config (`ClusterConfig.to_dict()`); per-process keys are not compared."""
    conflicts = []
    for key, value in given.items():
        if not prefix and key in PER_PROCESS_KEYS:
            continue
        have = running.get(key)
        if isinstance(value, dict) and isinstance(have, dict):
            conflicts += config_conflicts(value, have, f"{prefix}{key}.")
        elif value != have:
            conflicts.append(f"{prefix}{key}: the running cluster has {have!r}, this command asked for {value!r}")
    return conflicts
