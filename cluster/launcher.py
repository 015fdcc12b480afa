"""Starting and stopping the worker pools on Ray from one `ClusterConfig`.

`launch(config)` starts (or joins) Ray, hosts the rendezvous store for torch.distributed, starts P
prefill actors and D decode instances of `decode.tp_size` ranks, and waits for every actor to report
ready — with a timeout and a clear error when Ray cannot place them (Ray leaves an unsatisfiable actor
pending forever, so waiting without a bound would hang).

The ranks of a tensor-parallel decode instance all-reduce in every layer of every step: across nodes
that traffic would cross the network. Each such instance gets a STRICT_PACK placement group of one
bundle per rank, so Ray puts all its ranks on one node or none of them.
"""
from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig, PoolConfig
from cluster.messages import WorkerInfo
from engine.block_hash import spec_fingerprint
from kvtransfer.store import create_rendezvous_store


class ClusterStartError(RuntimeError):
    """The cluster could not start; the message says what did not fit or what failed."""


@dataclass
class DecodeInstance:
    instance_id: str
    ranks: list  # actor handles, rank 0 first
    info: WorkerInfo | None = None

    @property
    def driver(self):
        return self.ranks[0]


@dataclass
class PrefillHandle:
    worker_id: str
    actor: object
    info: WorkerInfo | None = None


@dataclass
class LaunchedCluster:
    config: ClusterConfig
    model_dir: str
    cluster_id: str
    prefill: list[PrefillHandle]
    decode: list[DecodeInstance]
    store: object  # keeps the rendezvous TCPStore alive for the cluster's lifetime
    started_ray: bool = False
    actors: list = field(default_factory=list)
    placement_groups: list = field(default_factory=list)  # one per tensor-parallel decode instance

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead: nothing to do
                pass
        self.actors.clear()
        for group in self.placement_groups:
            try:
                remove_placement_group(group)
            except Exception:  # Ray already gone: its groups went with it
                pass
        self.placement_groups.clear()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


def launch(config: ClusterConfig, model_dir: str | None = None) -> LaunchedCluster:
    model_dir = model_dir or config.model_dir or _demo_model_dir()
    started_ray = _ensure_ray(config)
    store = create_rendezvous_store(config.rendezvous_host)
    cluster = LaunchedCluster(config, str(model_dir), secrets.token_hex(3), [], [], store, started_ray)
    try:
        _start_actors(cluster, store.host, store.port)
        _wait_ready(cluster)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def _start_actors(cluster: LaunchedCluster, host: str, port: int) -> None:
    from decode_worker.worker import DecodeRank
    from prefill_worker.worker import PrefillWorker

    cfg, raw = cluster.config, cluster.config.to_dict()
    prefill_cls = ray.remote(PrefillWorker)
    for index in range(cfg.prefill.replicas):
        worker_id = f"{cluster.cluster_id}/prefill-{index}"
        actor = prefill_cls.options(name=worker_id, num_cpus=cfg.prefill.num_cpus, num_gpus=cfg.prefill.num_gpus,
                                    resources=_custom(cfg.prefill), runtime_env=_worker_env(cfg.prefill.threads)).remote(
            worker_id, raw, cluster.model_dir, host, port)
        cluster.actors.append(actor)
        cluster.prefill.append(PrefillHandle(worker_id, actor))
    decode_cls = ray.remote(DecodeRank)
    for index in range(cfg.decode.replicas):
        instance_id = f"{cluster.cluster_id}/decode-{index}"
        names = [f"{instance_id}/rank{r}" for r in range(cfg.decode.tp_size)]
        group = _rank_placement_group(cfg.decode, instance_id)
        if group is not None:
            cluster.placement_groups.append(group)
        ranks = []
        for rank in reversed(range(cfg.decode.tp_size)):  # followers first: rank 0 looks them up by name
            strategy = None if group is None else PlacementGroupSchedulingStrategy(group, rank)
            options = decode_cls.options(name=names[rank], num_cpus=cfg.decode.num_cpus,
                                         num_gpus=cfg.decode.num_gpus, resources=_custom(cfg.decode),
                                         runtime_env=_worker_env(cfg.decode.threads), scheduling_strategy=strategy)
            followers = tuple(names[1:]) if rank == 0 else ()
            ranks.insert(0, options.remote(instance_id, rank, raw, cluster.model_dir, host, port, followers))
        cluster.actors.extend(ranks)
        cluster.decode.append(DecodeInstance(instance_id, ranks))


def _rank_placement_group(pool: PoolConfig, instance_id: str):
    """One node for all ranks of a tensor-parallel instance (see the module docstring); None for TP 1."""
    if pool.tp_size == 1:
        return None
    bundle = {"CPU": pool.num_cpus, **({"GPU": pool.num_gpus} if pool.num_gpus else {}), **_custom(pool)}
    return placement_group([dict(bundle) for _ in range(pool.tp_size)], strategy="STRICT_PACK",
                           name=f"{instance_id}/ranks")


def _wait_ready(cluster: LaunchedCluster) -> None:
    refs = {a.ready.remote(): a for a in cluster.actors}
    done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=cluster.config.ready_timeout_s)
    if pending:
        raise ClusterStartError(_unplaced_message(cluster, len(pending)))
    infos = {id(refs[ref]): info for ref, info in zip(done, ray.get(done))}
    for handle in cluster.prefill:
        handle.info = infos[id(handle.actor)]
    for instance in cluster.decode:
        instance.info = infos[id(instance.driver)]
    for info in infos.values():
        if info.hash_spec != spec_fingerprint():
            raise ClusterStartError(f"worker {info.worker_id} uses block-hash spec {info.hash_spec!r}, "
                                    f"this process {spec_fingerprint()!r}; refusing to mix them")


def _unplaced_message(cluster: LaunchedCluster, num_pending: int) -> str:
    cfg = cluster.config
    available = ray.cluster_resources()
    return (f"{num_pending} of {len(cluster.actors)} worker actors were not ready within "
            f"{cfg.ready_timeout_s:.0f} s. The pools ask for {cfg.num_cpus_needed:g} CPUs "
            f"(prefill {cfg.prefill.replicas} x {cfg.prefill.num_cpus:g}, decode {cfg.decode.replicas} x "
            f"{cfg.decode.tp_size} ranks x {cfg.decode.num_cpus:g}) and GPUs "
            f"{cfg.prefill.replicas * cfg.prefill.num_gpus + cfg.decode.replicas * cfg.decode.tp_size * cfg.decode.num_gpus:g};"
            f" the Ray cluster has CPU={available.get('CPU', 0):g}, GPU={available.get('GPU', 0):g}"
            f"{'; all ranks of a decode instance must fit on one node' if cfg.decode.tp_size > 1 else ''}. "
            "Lower the pools' num_cpus/num_gpus or add capacity (or raise ready_timeout_s if loading is slow).")


def _ensure_ray(config: ClusterConfig) -> bool:
    if ray.is_initialized():
        return False
    num_cpus = None
    if config.ray_address is None:
        num_cpus = config.ray_num_cpus or max(2, math.ceil(config.num_cpus_needed))
    ray.init(address=config.ray_address, num_cpus=num_cpus, include_dashboard=False, namespace="splitserve",
             log_to_driver=True, configure_logging=False)
    return True


def _custom(pool) -> dict:
    return {pool.ray_resource: 1} if pool.ray_resource else {}


def _worker_env(threads: int) -> dict:
    value = str(threads)
    return {"env_vars": {"OMP_NUM_THREADS": value, "MKL_NUM_THREADS": value,
                         "TOKENIZERS_PARALLELISM": "false",
                         "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}}


def _demo_model_dir() -> str:
    from engine.demo_model import ensure_demo_model

    return str(ensure_demo_model())
