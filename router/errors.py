"""Domain exception → gRPC status, in one table (used by the one error interceptor).

Anything not listed is a bug: it becomes INTERNAL with a generic message (details go to the log,
never to the client) — and the fuzz tests assert that no request can cause it.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc

from cluster.client import RequestFailed
from engine.errors import InvalidRequestError
from policies.routing import NoWorkersError
from router.service_types import DuplicateRequest, Overloaded

KV_FULL_RETRY_AFTER_S = 1.0  # a full decode pool frees blocks as its requests finish


class Unauthenticated(RuntimeError):
    """Missing or wrong bearer token."""


class Status(NamedTuple):
    code: grpc.StatusCode
    details: str
    field: str | None = None
    retry_after_s: float | None = None

    @property
    def outcome(self) -> str:
        return self.code.name.lower()


def status_for(error: BaseException) -> Status:
    if isinstance(error, InvalidRequestError):
        return Status(grpc.StatusCode.INVALID_ARGUMENT, str(error), error.field)
    if isinstance(error, RequestFailed):
        if error.field is not None:
            return Status(grpc.StatusCode.INVALID_ARGUMENT, error.reason, error.field)
        if error.timed_out:
            return Status(grpc.StatusCode.DEADLINE_EXCEEDED, error.reason)
        if error.out_of_capacity:
            return Status(grpc.StatusCode.RESOURCE_EXHAUSTED, error.reason, None, KV_FULL_RETRY_AFTER_S)
        return Status(grpc.StatusCode.UNAVAILABLE, error.reason)
    if isinstance(error, Overloaded):
        return Status(grpc.StatusCode.RESOURCE_EXHAUSTED, error.reason, None, error.retry_after_s)
    if isinstance(error, DuplicateRequest):
        return Status(grpc.StatusCode.ALREADY_EXISTS, str(error), "request_id")
    if isinstance(error, NoWorkersError):
        return Status(grpc.StatusCode.UNAVAILABLE, str(error))
    if isinstance(error, Unauthenticated):
        return Status(grpc.StatusCode.UNAUTHENTICATED, str(error))
    return Status(grpc.StatusCode.INTERNAL, "internal router error (see the router's log)")
