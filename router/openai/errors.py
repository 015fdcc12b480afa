"""The HTTP front's one mapping point: exception → HTTP status + OpenAI's error JSON (+ headers).

Domain exceptions go through the router's own table first (`router.errors.status_for`, which the
gRPC interceptor uses too), so both fronts classify every failure the same way; this module only
says how each class looks over HTTP:

| class (gRPC code) | HTTP | error.type | error.code |
|---|---|---|---|
| invalid argument | 400 | invalid_request_error | invalid_value |
| a body over the size limit (invalid argument) | 413 | invalid_request_error | body_too_large |
| unauthenticated | 401 | authentication_error | invalid_api_key |
| unknown model | 404 | invalid_request_error | model_not_found |
| request id already running (already exists) | 409 | invalid_request_error | request_id_in_use |
| admission, concurrency, full KV pool (resource exhausted) | 429 + Retry-After | rate_limit_error | overloaded |
| worker lost, no worker (unavailable) | 503 | service_unavailable | unavailable |
| deadline | 504 | timeout | deadline_exceeded |
| anything else (a bug) | 500 | server_error | internal_error |

`error.param` names the field as the client sent it. `Retry-After` is whole seconds (rounded up, as
HTTP wants); `retry-after-ms` carries the exact figure (the `openai` client reads it first).
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

import grpc

from engine.errors import InvalidRequestError
from router.errors import Status, status_for
from router.openai.parse import BodyTooLarge, ModelNotFound

# gRPC code → (HTTP status, error.type, error.code); the OpenAPI document lists ALL_ERRORS.
HTTP_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "request_id_in_use"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
}
INTERNAL_ERROR = (500, "server_error", "internal_error")
BODY_TOO_LARGE = (413, "invalid_request_error", "body_too_large")
ALL_ERRORS = (*HTTP_ERRORS.values(), BODY_TOO_LARGE, INTERNAL_ERROR)  # every (status, type, code) answered
# Fields the domain names the gRPC way → how the OpenAI body calls them.
_PROMPT_FIELDS = ("text", "token_ids", "prompt")


class HttpError(NamedTuple):
    status: int
    body: bytes  # {"error": {"message", "type", "param", "code"}}
    headers: dict[str, str]
    outcome: str  # the requests_total outcome label (the gRPC status name, as for gRPC calls)

    @property
    def event(self) -> bytes:
        """The same error as a server-sent event, for a stream whose 200 was already sent."""
        return b"data: " + self.body + b"\n\n"


def http_error(error: BaseException, prompt_field: str = "prompt") -> HttpError:
    """`prompt_field`: what the endpoint calls its prompt (`prompt`, or `messages` for chat)."""
    status = _status(error)
    http_status, error_type, code = (
        BODY_TOO_LARGE if isinstance(error, BodyTooLarge) else HTTP_ERRORS.get(status.code, INTERNAL_ERROR)
    )
    param = status.field
    if param is not None:
        param = param.removeprefix("sampling.").removeprefix("slo.")
        param = prompt_field if param in _PROMPT_FIELDS else param
    reason = error.reason if isinstance(error, InvalidRequestError) else status.details
    message = reason if param is None or reason.startswith(f"{param}:") else f"{param}: {reason}"
    body = json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}}).encode()
    headers = {}
    if status.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(status.retry_after_s)))
        headers["retry-after-ms"] = str(int(status.retry_after_s * 1000))
    return HttpError(http_status, body, headers, status.outcome)


def _status(error: BaseException) -> Status:
    if isinstance(error, ModelNotFound):
        return Status(grpc.StatusCode.NOT_FOUND, str(error), "model")
    return status_for(error)
