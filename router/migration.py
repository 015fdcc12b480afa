"""Migration: the one owner of what happens when a worker is lost under a request.

A lost worker fails only an *attempt*. The router starts another one elsewhere: the prompt plus every
token already streamed are prefilled again and decoding resumes at the next token, so the client sees
one unbroken stream equal to a fault-free run (docs/architecture.md, "Failure handling"). This module
decides, from the facts the cluster client reports on a failed attempt (`RequestFailed`: its phase,
the worker found dead), three things:

* whether the request migrates at all (only worker loss does: `unavailable`; a refusal, a deadline or a
  full pool ends it);
* whether the migration counts toward `router.migration_limit`, which stops a request that kills every
  worker it lands on. Only a loss the request may have caused counts: a worker lost while computing it
  (prefilling, or decoding). Not counted: a prefill worker lost while the request waited in its queue
  or for its prefix pull, and a loss during the hand-off (the prefill worker had computed the request
  and no decode step had run it). The deadline still bounds those;
* the cause, for the `splitserve_router_migrations_total{cause}` metric.
"""

from __future__ import annotations

from enum import StrEnum

from cluster.client import AttemptPhase, RequestFailed
from common.membership import Member


class MigrationCause(StrEnum):
    PREFILL_LOST = "prefill_lost"
    DECODE_LOST = "decode_lost"
    HANDOFF_FAILED = "handoff_failed"
    WORKER_FAILED = "worker_failed"


def migrates(err: RequestFailed) -> bool:
    """A failed attempt moves the request elsewhere only when a worker, not the request, failed."""
    return err.unavailable


def counts_toward_limit(err: RequestFailed) -> bool:
    """The counting rule of `router.migration_limit` (module docstring)."""
    if err.phase is AttemptPhase.QUEUED:
        return err.lost_worker is None
    if err.phase is AttemptPhase.HANDOFF:
        return err.lost_worker is None and not err.decode_lost
    return True


def cause_of(err: RequestFailed, prefill: Member, decode: Member) -> MigrationCause:
    """Which part of the route was lost."""
    if err.lost_worker == (prefill.worker_id, prefill.epoch):
        return MigrationCause.PREFILL_LOST
    if err.lost_worker == (decode.worker_id, decode.epoch):
        return MigrationCause.DECODE_LOST
    return MigrationCause.HANDOFF_FAILED if err.phase is AttemptPhase.HANDOFF else MigrationCause.WORKER_FAILED


class Migrations:
    """One request's migrations: how many in all (the client is told), and how many the limit counts."""

    def __init__(self, limit: int):
        self.limit = limit
        self.total = 0
        self.counted = 0

    def migrate(self, err: RequestFailed) -> None:
        """Accounts one more migration after `err`, or raises when the request must fail instead: `err`
        itself when it is not worker loss, an UNAVAILABLE `RequestFailed` naming the limit when it is spent."""
        if not migrates(err):
            raise err
        counts = counts_toward_limit(err)
        if counts and self.counted >= self.limit:
            raise RequestFailed(f"{err.reason} (after {self.counted} migration(s), the limit)", unavailable=True)
        self.total += 1
        self.counted += counts
