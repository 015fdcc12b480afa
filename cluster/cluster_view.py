"""A router's live view of the cluster: the controller's membership, followed by long-poll.

Routers are stateless peers: what they know of the workers comes from here, never from actor-name
conventions. `ClusterView` holds the latest `Membership` and tells its listeners (the worker monitor,
the prefix-index feeder, the router's own bookkeeping) about every new version. A worker that leaves
(dead, draining) stops receiving new requests within one watch round trip; requests already on it
keep their own handles. When the controller restarts, pending watches are retried by Ray and the
restarted controller answers with the same version, so nothing moves.
The watch asks for deltas (`watch_delta`): the controller answers with what changed since the view's
version, or with the whole membership when it no longer holds that version; either brings the view to
the current version in one round trip (common/membership.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import ray

from cluster.launcher import LaunchedCluster
from common.config import ClusterConfig
from common.membership import Member, Membership, MembershipDelta

log = logging.getLogger(__name__)
WATCH_S = 5.0  # one long-poll's wait at the controller
WATCH_SLACK_S = 10.0  # beyond it, the call itself is given up and retried (controller restarting)
RETRY_S = 0.5


class ClusterView:
    def __init__(self, launched: LaunchedCluster):
        self.controller = launched.controller
        self.config: ClusterConfig = launched.config
        self.model_dir = launched.model_dir
        self.membership: Membership = launched.membership
        self.listeners: list[Callable[[Membership, Membership], None]] = []  # (old, new)
        # called each time the controller stops answering watches (it is restarting, or gone)
        self.outage_listeners: list[Callable[[], None]] = []
        self._task: asyncio.Task | None = None
        # The long-poll in flight (cancelled on close: the controller may outlive us).
        self._watch: ray.ObjectRef | None = None
        self._waiters: set[asyncio.Future] = set()

    @property
    def prefill(self) -> list[Member]:
        return self.membership.prefill

    @property
    def decode(self) -> list[Member]:
        return self.membership.decode

    @property
    def members(self) -> tuple[Member, ...]:
        return self.membership.members

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._follow())

    def apply(self, membership: Membership) -> None:
        """Adopt a newer membership and tell the listeners (a stale or equal version is ignored)."""
        old = self.membership
        if membership.cluster_id == old.cluster_id and membership.version <= old.version:
            return
        self.membership = membership
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        for listener in self.listeners:
            try:
                listener(old, membership)
            except Exception:  # one listener's bug must not stop the others or the watch
                log.exception("membership listener failed")

    async def wait_for_change(self, timeout_s: float) -> None:
        """Returns at the next new membership, or after `timeout_s`."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, max(timeout_s, 0.0))
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)

    async def _follow(self) -> None:
        failing = False
        while True:
            try:
                known = self.membership
                self._watch = self.controller.watch_delta(known.cluster_id, known.version, WATCH_S)
                answer = await asyncio.wait_for(self._watch, WATCH_S + WATCH_SLACK_S)
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - controller restarting or gone: keep the last membership, retry
                if not failing:
                    log.warning("cannot watch the cluster controller: %s", type(err).__name__)
                    for listener in self.outage_listeners:
                        listener()
                failing = True
                await asyncio.sleep(RETRY_S)
                continue
            self.apply(follow(self.membership, answer))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._watch is not None:
            ray.cancel(self._watch)
            self._watch = None


def follow(view: Membership, answer: Membership | MembershipDelta) -> Membership:
    """The view after a watch answer: a delta applied to the version it is from, or the whole membership
    (a delta from another version, possible only after a concurrent apply, changes nothing: the next
    watch asks again from the view's version)."""
    if isinstance(answer, Membership):
        return answer
    if answer.cluster_id == view.cluster_id and answer.base_version == view.version:
        return answer.apply(view)
    return view
