"""What the router service hands its front ends: the outputs `RouterService.generate` yields and the
refusals it raises of its own (the error interceptor maps them to status codes: router/errors.py).

Plain data, no gRPC: the gRPC servicer and the OpenAI front translate these into their own terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.stream_state import Usage


class Overloaded(RuntimeError):
    """The router refuses new work now; `retry_after_s` suggests when to try again."""

    def __init__(self, reason: str, retry_after_s: float | None):
        super().__init__(reason)
        self.reason, self.retry_after_s = reason, retry_after_s


class DuplicateRequest(RuntimeError):
    """A request with the same request_id is still running."""


@dataclass(frozen=True)
class RouteInfo:
    prefill_worker: str
    decode_instance: str
    policy: str
    cached_prompt_tokens: int


@dataclass(frozen=True)
class RouterOutput:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple  # engine.sampler.TokenLogprobs per token, when requested
    finish_reason: str | None
    route: RouteInfo | None = None
    usage: Usage | None = None
    migrations: int = 0  # on the last output: how many times the request moved to other workers
    # On the last output: seconds the router spent waiting on the cluster for this request (all attempts);
    # what the client saw minus this is what the router path added to it.
    upstream_s: float | None = None
    # On the first output, when params.prompt_logprobs is set: (prompt token i + 1, its TokenLogprobs).
    prompt_logprobs: tuple | None = None
