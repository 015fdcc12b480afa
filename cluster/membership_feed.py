"""The controller's membership publication: the current version, a short history, and long-polls.

`MembershipFeed` is the part of the controller that watchers talk to (plain asyncio, no Ray, so it is
tested with simulated watchers in one event loop). `publish` makes a new version; `watch` answers the
whole membership once it differs from a watcher's version (what workers and tools read);
`watch_delta` answers a `MembershipDelta` from the watcher's version to the current one when that
version is still in the history, else the whole membership — so each answer brings a watcher up to
date in one round trip, and an answer costs the size of the change, not of the fleet.
One event loop owns the feed (the controller actor's).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict

from common.membership import Membership, MembershipDelta, membership_delta

HISTORY_VERSIONS = 64  # versions a delta can start from; a watcher further behind gets the whole membership


class MembershipFeed:
    def __init__(self, initial: Membership, history_versions: int = HISTORY_VERSIONS):
        if history_versions < 1:
            raise ValueError(f"history_versions must be >= 1, got {history_versions}")
        self.current = initial
        self._history: OrderedDict[int, Membership] = OrderedDict({initial.version: initial})
        self._history_versions = history_versions
        self._changed: asyncio.Future = asyncio.get_running_loop().create_future()
        self._deltas: dict[int, MembershipDelta] = {}  # base version → delta to current (shared by watchers)

    def restore(self, membership: Membership) -> None:
        """Makes `membership` current at its own version (a restarted controller resuming): no history."""
        self.current = membership
        self._history = OrderedDict({membership.version: membership})
        self._deltas.clear()

    def publish(self, membership: Membership) -> None:
        """Makes `membership` (a higher version) current and wakes every watcher."""
        if membership.version <= self.current.version and membership.cluster_id == self.current.cluster_id:
            raise ValueError(f"version {membership.version} is not newer than {self.current.version}")
        if membership.cluster_id != self.current.cluster_id:
            self._history.clear()
        self.current = membership
        self._history[membership.version] = membership
        while len(self._history) > self._history_versions:
            self._history.popitem(last=False)
        self._deltas.clear()
        self._changed.set_result(None)
        self._changed = asyncio.get_running_loop().create_future()

    async def _wait_change(self, known_version: int, timeout_s: float) -> None:
        if self.current.version == known_version:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._changed), timeout_s)

    async def watch(self, known_version: int, timeout_s: float) -> Membership:
        """The membership once its version differs from `known_version`, or the current one after `timeout_s`."""
        await self._wait_change(known_version, timeout_s)
        return self.current

    async def watch_delta(self, cluster_id: str, known_version: int, timeout_s: float) -> Membership | MembershipDelta:
        """As `watch`, answered as a delta from `known_version` when the history still holds it (and the
        cluster is the same); the whole membership otherwise."""
        if cluster_id == self.current.cluster_id:
            await self._wait_change(known_version, timeout_s)
        return self.delta_from(cluster_id, known_version)

    def delta_from(self, cluster_id: str, known_version: int) -> Membership | MembershipDelta:
        current = self.current
        base = self._history.get(known_version) if cluster_id == current.cluster_id else None
        if base is None:
            return current
        delta = self._deltas.get(known_version)
        if delta is None:  # computed once per base version, whatever the number of watchers at it
            delta = self._deltas[known_version] = membership_delta(base, current)
        return delta
