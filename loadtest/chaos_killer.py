"""The killing half of `splitserve chaos`: every `every_s` while the workload issues requests, SIGKILL
one serving worker through the controller, and time each kill until the pools are back to full strength."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time

from common.actor_api import ControllerHandle

RECOVERY_POLL_S = 2.0


class Killer:
    """`controller` is the cluster's controller; `kind` is prefill, decode or any."""

    def __init__(self, controller: ControllerHandle, kind: str, every_s: float, rng: random.Random, echo=print):
        self.controller, self.kind, self.every_s, self.rng, self.echo = controller, kind, every_s, rng, echo
        self.kills: list[dict] = []
        self._watchers: list[asyncio.Task] = []
        self._started_s = time.monotonic()

    async def run(self, duration_s: float | None) -> None:
        """Kills at every_s, 2 every_s, ... before `duration_s` (the workload's issuing time: the drain after
        it sees no more kills, so a slow cluster gets no extra ones), or until cancelled when it is None."""
        kills = itertools.count() if duration_s is None else range(math.ceil(duration_s / self.every_s) - 1)
        for _ in kills:
            await asyncio.sleep(self.every_s)
            await self._kill_one()

    async def _kill_one(self) -> None:
        membership = await self.controller.membership()
        roles = ("prefill", "decode") if self.kind == "any" else (self.kind,)
        candidates = [m for role in roles for m in membership.serving(role)]
        if not candidates:
            self.echo("chaos: no serving worker to kill now (all are being replaced)")
            return
        victim = self.rng.choice(candidates)
        killed_s = time.monotonic()
        if not await self.controller.kill_worker(victim.worker_id):
            return
        kill = {
            "worker_id": victim.worker_id,
            "role": victim.role,
            "epoch": victim.epoch,
            "at_s": round(killed_s - self._started_s, 3),
            "replaced_s": None,
            "recovered_s": None,
        }
        self.kills.append(kill)
        self.echo(f"chaos: SIGKILL {victim.worker_id} (epoch {victim.epoch}) at {kill['at_s']:.1f} s")
        self._watchers.append(asyncio.ensure_future(self._until_recovered(kill, killed_s)))

    async def _until_recovered(self, kill: dict, killed_s: float) -> None:
        config = await self.controller.cluster_config()
        desired = {role: config[role]["replicas"] for role in ("prefill", "decode")}
        membership = await self.controller.membership()
        while not _full_strength(membership, desired, kill):
            if kill["replaced_s"] is None and _replaced(membership, kill):
                kill["replaced_s"] = round(time.monotonic() - killed_s, 3)
            membership = await self.controller.watch(membership.version, RECOVERY_POLL_S)
        now_s = round(time.monotonic() - killed_s, 3)
        kill["replaced_s"] = kill["replaced_s"] or now_s
        kill["recovered_s"] = now_s

    async def settle(self, timeout_s: float) -> list[dict]:
        """Waits (bounded) for the last kills to recover; the ones that did not keep recovered_s None."""
        if self._watchers:
            _, pending = await asyncio.wait(self._watchers, timeout=timeout_s)
            for task in pending:
                task.cancel()
        return self.kills


def _replaced(membership, kill: dict) -> bool:
    """The victim's slot serves again, with a new epoch."""
    member = membership.get(kill["worker_id"])
    return member is not None and member.epoch > kill["epoch"] and member in membership.serving(member.role)


def _full_strength(membership, desired: dict[str, int], kill: dict) -> bool:
    """Every pool at its desired size and the victim replaced (later kills may delay this)."""
    return all(len(membership.serving(role)) >= count for role, count in desired.items()) and _replaced(
        membership, kill
    )
