"""Creating and ending the Ray actors of one start of one pool slot (the controller's hands).

Every worker actor is *detached*: it belongs to the Ray cluster, not to the controller that created
it, so a controller crash kills no worker. Each start gets a new epoch, and its actor names carry
it (the controller finds its actors again by these names after a restart; nobody else uses them).

The ranks of a tensor-parallel decode instance all-reduce in every layer of every step: across nodes
that traffic would cross the network. Each such instance gets a STRICT_PACK placement group of one
bundle per rank, so Ray puts all its ranks on one node or none of them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common.config import ClusterConfig, PoolConfig
from common.logs import actor_log_env


@dataclass(frozen=True)
class StartedActors:
    ranks: tuple  # actor handles, rank 0 first
    actor_names: tuple[str, ...]
    placement_group: str | None


def actor_name(cluster_name: str, worker_id: str, epoch: int, rank: int) -> str:
    return f"{cluster_name}:{worker_id}@{epoch}/rank{rank}"


def planned_names(
    cluster_name: str, config: ClusterConfig, worker_id: str, role: str, epoch: int
) -> tuple[tuple[str, ...], str | None]:
    """The actor names (rank 0 first) and placement group name a start will use: recorded before the
    actors exist, so that a controller dying in between finds (or misses) exactly these."""
    ranks = config.decode.tp_size if role == "decode" else 1
    names = tuple(actor_name(cluster_name, worker_id, epoch, r) for r in range(ranks))
    return names, (f"{cluster_name}:{worker_id}@{epoch}/ranks" if ranks > 1 else None)


def start_worker(
    cluster_name: str,
    config: ClusterConfig,
    model_dir: str,
    worker_id: str,
    role: str,
    epoch: int,
    store_host: str,
    store_port: int,
) -> StartedActors:
    """Creates the actors of one start of a worker; returns at once (they load in the background)."""
    raw = config.to_dict()
    names, group_name = planned_names(cluster_name, config, worker_id, role, epoch)
    if role == "prefill":
        from prefill_worker.worker import PrefillWorker

        actor = (
            ray.remote(PrefillWorker)
            .options(name=names[0], **_options(config.prefill))
            .remote(worker_id, epoch, raw, model_dir, store_host, store_port)
        )
        return StartedActors((actor,), names, None)
    from decode_worker.worker import DecodeRank

    pool = config.decode
    group = _rank_placement_group(pool, group_name)
    decode_cls = ray.remote(DecodeRank)
    ranks: list = []
    for rank in reversed(range(pool.tp_size)):  # followers first: rank 0 gets their handles
        strategy = None if group is None else PlacementGroupSchedulingStrategy(group, rank)
        followers = tuple(ranks) if rank == 0 else ()
        ranks.insert(
            0,
            decode_cls.options(name=names[rank], scheduling_strategy=strategy, **_options(pool)).remote(
                worker_id, epoch, rank, raw, model_dir, store_host, store_port, followers
            ),
        )
    return StartedActors(tuple(ranks), names, group_name)


def find_actor(name: str):
    """The live actor of this name (recorded before a controller restart), or None: it is gone."""
    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def end_worker(ranks, placement_group_name: str | None = None) -> None:
    """Kills every rank (no restart) and removes the placement group; tolerates what is already gone."""
    for handle in ranks:
        with contextlib.suppress(Exception):  # already dead: nothing to do
            ray.kill(handle, no_restart=True)
    if placement_group_name is not None:
        with contextlib.suppress(Exception):  # already removed, or Ray gone
            remove_placement_group(ray.util.get_placement_group(placement_group_name))


def _rank_placement_group(pool: PoolConfig, name: str | None):
    """One node for all ranks of a tensor-parallel instance (see the module docstring); None for TP 1."""
    if pool.tp_size == 1 or name is None:  # planned_names names a group exactly when TP > 1
        return None
    bundle = {"CPU": pool.num_cpus, **({"GPU": pool.num_gpus} if pool.num_gpus else {}), **_custom(pool)}
    return placement_group(
        [dict(bundle) for _ in range(pool.tp_size)], strategy="STRICT_PACK", name=name, lifetime="detached"
    )


def _options(pool: PoolConfig) -> dict:
    return {
        "num_cpus": pool.num_cpus,
        "num_gpus": pool.num_gpus,
        "resources": _custom(pool),
        "lifetime": "detached",
        "max_restarts": 0,
        "runtime_env": _worker_env(pool.threads),
    }


def _custom(pool: PoolConfig) -> dict:
    return {pool.ray_resource: 1} if pool.ray_resource else {}


def _worker_env(threads: int) -> dict:
    value = str(threads)
    return {
        "env_vars": {
            "OMP_NUM_THREADS": value,
            "MKL_NUM_THREADS": value,
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            **actor_log_env(),  # --log-level / --log-format of the serve command that started the cluster
        },
    }
