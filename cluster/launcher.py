"""Starting or joining a cluster from any process: `launch(config)` → a `LaunchedCluster` handle.

The cluster belongs to its controller (`cluster/controller.py`), a named, detached Ray actor, not to
the process that asked for it. `launch` starts (or joins) Ray, starts the controller if none runs for
`config.cluster_name` in that Ray cluster — or joins the one that does, refusing when keys this
process set explicitly disagree with the running cluster's config — and waits until the pools serve
(bounded: a pool Ray cannot place fails with the resources asked and available instead of hanging).

`LaunchedCluster.shutdown()` ends the pools only if this process started the controller; a process
that joined leaves them serving. The returned handle's `prefill` / `decode` are the membership as of
launch (or the last `refresh`); routers follow membership live (`cluster/cluster_view.py`).
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayTaskError

from cluster.controller import ClusterController, controller_name
from cluster.controller_slots import ClusterStartError  # re-exported: callers catch it here
from common.actor_api import ControllerHandle
from common.config import PER_PROCESS_KEYS, ClusterConfig, ConfigError
from common.logs import actor_log_env
from common.membership import Member, Membership

RAY_NAMESPACE = "splitserve"
JOIN_TIMEOUT_S = 10.0  # a controller that does not answer this fast is not there (or broken)
PROGRESS_EVERY_S = 3.0
HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


class ClusterNotFound(RuntimeError):
    """No controller runs for the cluster name in this Ray cluster (and the caller would only join)."""


@dataclass
class LaunchedCluster:
    config: ClusterConfig  # the running cluster's config, with this process's own router/admission sections
    model_dir: str
    controller: ControllerHandle
    membership: Membership
    owns_controller: bool  # this process started it: shutdown() ends the pools
    started_ray: bool = False

    @property
    def cluster_id(self) -> str:
        return self.membership.cluster_id

    @property
    def prefill(self) -> list[Member]:
        return self.membership.prefill

    @property
    def decode(self) -> list[Member]:
        return self.membership.decode

    def refresh(self, timeout_s: float = 30.0) -> Membership:
        """Fetch the controller's current membership."""
        self.membership = ray.get(self.controller.membership(), timeout=timeout_s)
        return self.membership

    def wait_for(self, predicate: Callable[[Membership], bool], timeout_s: float) -> Membership:
        """Follow membership until `predicate` holds; raises TimeoutError naming the last version."""
        deadline_s = time.monotonic() + timeout_s
        while not predicate(self.membership):
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                raise TimeoutError(
                    f"membership did not reach the expected state within {timeout_s:.0f} s "
                    f"(version {self.membership.version}: "
                    f"{[(m.worker_id, m.epoch, m.state) for m in self.membership.members]})"
                )
            self.membership = ray.get(
                self.controller.watch(self.membership.version, min(left_s, 5.0)), timeout=left_s + 10.0
            )
        return self.membership

    def scale(self, role: str, replicas: int) -> None:
        ray.get(self.controller.scale(role, replicas), timeout=JOIN_TIMEOUT_S)

    def shutdown(self) -> None:
        if self.owns_controller:
            with contextlib.suppress(Exception):  # already gone: nothing left to stop
                ray.get(self.controller.shutdown(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(self.controller.actor, no_restart=True)
        if self.started_ray and ray.is_initialized():
            ray.shutdown()


def launch(
    config: ClusterConfig,
    model_dir: str | None = None,
    *,
    given: dict | None = None,
    join_only: bool = False,
    on_progress: Callable[[str], None] | None = None,
) -> LaunchedCluster:
    """Start or join the cluster `config.cluster_name` (None: a new one). `given`: the plain-data keys the
    caller set explicitly (CLI flags, YAML), checked against a running cluster; default: all of `config`.
    `join_only`: raise ClusterNotFound instead of starting a controller. `on_progress` hears what happens."""
    say = on_progress or (lambda _: None)
    started_ray = _ensure_ray(config)
    try:
        name = config.cluster_name or f"c{secrets.token_hex(4)}"
        if join_only and connect_controller(name) is None:
            raise ClusterNotFound(
                f"no controller runs for cluster {name!r} in this Ray cluster; start one "
                "with `splitserve controller` or `splitserve serve`"
            )
        controller, owns = _start_or_join(name, config, model_dir, given, say)
    except BaseException:
        if started_ray and ray.is_initialized():
            ray.shutdown()
        raise
    try:
        membership = _wait_ready(controller, config.ready_timeout_s, say)
        running = ClusterConfig.from_dict(ray.get(controller.cluster_config(), timeout=JOIN_TIMEOUT_S))
    except BaseException:  # a cluster this call started and that cannot serve is not left behind retrying
        LaunchedCluster(config, "", controller, Membership("", 0), owns, started_ray).shutdown()
        raise
    mine = {key: getattr(config, key) for key in ("router", "admission", "ray_address", "ray_num_cpus")}
    merged = ClusterConfig(**{**{f: getattr(running, f) for f in running.__dataclass_fields__}, **mine})
    assert running.model_dir is not None, "the controller records the model it serves"
    return LaunchedCluster(merged, running.model_dir, controller, membership, owns, started_ray)


def connect_controller(cluster_name: str) -> ControllerHandle | None:
    """The running controller of `cluster_name`, or None (checked with a bounded ping)."""
    try:
        controller = ControllerHandle(ray.get_actor(controller_name(cluster_name), namespace=RAY_NAMESPACE))
        ray.get(controller.ping(), timeout=JOIN_TIMEOUT_S)
    except (ValueError, ray.exceptions.ActorDiedError):  # none, or one being removed
        return None
    return controller


def _start_or_join(
    name: str, config: ClusterConfig, model_dir: str | None, given: dict | None, say
) -> tuple[ControllerHandle, bool]:
    controller = connect_controller(name)
    if controller is not None:
        say(f"joining the running cluster {name!r}")
        explicit = given if given is not None else _non_null(config.to_dict())
        try:
            ray.get(controller.check_join(explicit), timeout=JOIN_TIMEOUT_S)
        except RayTaskError as err:
            cause = getattr(err, "cause", None)
            raise (cause if isinstance(cause, ConfigError) else err) from None
        return controller, False
    say(f"starting the controller of cluster {name!r}")
    model_dir = str(model_dir or config.model_dir or _demo_model_dir())
    # A planner that patches the RayCluster needs the service-account token, which the chart mounts on
    # the Ray head only: the controller is pinned there (a sliver of the head's own resource).
    head = {HEAD_RESOURCE: 0.001} if config.planner.enabled and config.planner.raycluster_name else {}
    options = ray.remote(ClusterController).options(
        name=controller_name(name),
        namespace=RAY_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        resources=head,
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=1000,
        runtime_env=_controller_env(),
    )
    return ControllerHandle(options.remote(name, config.to_dict(), model_dir)), True


def _controller_env() -> dict:
    # The log settings too: the controller passes them on to the workers it starts.
    return {"env_vars": {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), **actor_log_env()}}


def _wait_ready(controller: ControllerHandle, timeout_s: float, say) -> Membership:
    """Until the pools serve, telling `say` how far they got every few seconds. The whole wait, the
    controller's own start included, is bounded by `timeout_s` (plus a little for the calls)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        left_s = max(deadline_s - time.monotonic(), 0.1)
        try:
            return ray.get(controller.wait_ready(min(PROGRESS_EVERY_S, left_s)), timeout=left_s + JOIN_TIMEOUT_S)
        except RayTaskError as err:
            cause = getattr(err, "cause", None)
            if not isinstance(cause, ClusterStartError):
                raise
            if time.monotonic() >= deadline_s:
                raise cause from None
        except GetTimeoutError:
            raise ClusterStartError(f"the cluster controller did not answer within {timeout_s:.0f} s") from None
        with contextlib.suppress(GetTimeoutError):
            say(ray.get(controller.progress(), timeout=JOIN_TIMEOUT_S))


def _non_null(raw: dict) -> dict:
    """Keys with a value (None means "whatever the cluster has"), minus per-process ones."""
    return {
        k: (_non_null(v) if isinstance(v, dict) else v)
        for k, v in raw.items()
        if v is not None and k not in PER_PROCESS_KEYS
    }


def _ensure_ray(config: ClusterConfig) -> bool:
    if ray.is_initialized():
        return False
    num_cpus = None
    if config.ray_address is None:
        num_cpus = config.ray_num_cpus or max(2, math.ceil(config.num_cpus_needed))
    ray.init(
        address=config.ray_address,
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace=RAY_NAMESPACE,
        log_to_driver=True,
        configure_logging=False,
    )
    return True


def _demo_model_dir() -> str:
    from engine.demo_model import ensure_demo_model

    return str(ensure_demo_model())
