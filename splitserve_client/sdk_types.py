"""What the client SDK hands its users: plain frozen dataclasses and typed errors (grpcio + protobuf only).

Errors carry the gRPC status, the reason the router gave, the request field it named (for
INVALID_ARGUMENT) and the retry-after it suggested (for RESOURCE_EXHAUSTED), read from the trailing
metadata keys below, which the router's error interceptor sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from splitserve_client.protocol import splitserve_v1_pb2 as pb

FIELD_KEY = "splitserve-field"
RETRY_AFTER_KEY = "splitserve-retry-after-ms"
REQUEST_ID_KEY = "splitserve-request-id"
# Request metadata: when the client first sent the request (Unix time, µs). The router counts the time
# since then against the TTFT SLO, so a request that waited in the client or in the router's intake is
# judged by the TTFT its client will see (like HTTP's X-Request-Start). Needs clocks in sync (NTP).
SENT_AT_KEY = "splitserve-sent-at-us"
# Trailing metadata of a finished Generate: milliseconds the router spent waiting on the cluster for it
# (like Envoy's x-envoy-upstream-service-time); the client's latency minus this is the router's share.
UPSTREAM_MS_KEY = "splitserve-upstream-ms"

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


class SplitserveError(Exception):
    """A call failed. `code` is the gRPC status; `reason` the router's message; `field` the request
    field it names (INVALID_ARGUMENT); `retry_after_s` when the router suggested one."""

    def __init__(
        self, code: grpc.StatusCode, reason: str, field: str | None = None, retry_after_s: float | None = None
    ):
        super().__init__(f"{code.name}: {reason}")
        self.code, self.reason, self.field, self.retry_after_s = code, reason, field, retry_after_s


class InvalidArgument(SplitserveError):
    """The request itself is wrong; `field` names the bad field. Never retried."""


class Unauthenticated(SplitserveError):
    """Missing or wrong bearer token."""


class ResourceExhausted(SplitserveError):
    """Rejected by admission control or the concurrency limit; see `retry_after_s`."""


class Unavailable(SplitserveError):
    """A worker or the router was unreachable; retried automatically before the first token."""


class DeadlineExceeded(SplitserveError):
    """The call's deadline passed; the cluster freed the request's blocks."""


class AlreadyExists(SplitserveError):
    """A request with this request_id is still running."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
}


def error_from_rpc(err: grpc.RpcError) -> SplitserveError:
    """Turns a failed call (sync or asyncio) into the typed error for its status."""
    code = err.code()
    # The grpc stub types metadata items as a plain class; at run time they are (key, value) tuples, and
    # values are str for keys without the -bin suffix, as ours are.
    trailing: dict[str, str] = dict(err.trailing_metadata() or ())  # type: ignore[arg-type]
    retry_ms = trailing.get(RETRY_AFTER_KEY)
    retry_after_s = float(retry_ms) / 1000.0 if retry_ms else None
    cls = _ERRORS.get(code, SplitserveError)
    return cls(code, err.details() or "", trailing.get(FIELD_KEY) or None, retry_after_s)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the top alternatives


@dataclass(frozen=True)
class Route:
    prefill_worker: str
    decode_instance: str
    policy: str
    cached_prompt_tokens: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message: the tokens (and text) since the previous one."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None  # "stop" / "length" on the last chunk
    route: Route | None  # first chunk only
    usage: Usage | None  # last chunk only
    migrations: int = 0  # last chunk only: times the router moved the request to other workers
    # First chunk only, when prompt_logprobs was asked: entry i scores prompt token i + 1.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A whole generation (non-streaming `generate`)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] = ()
    route: Route | None = None
    usage: Usage | None = None
    attempts: int = 1  # calls the SDK made (it retries UNAVAILABLE before the first token)
    migrations: int = 0  # times the router moved the request to other workers (an unbroken stream)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # when asked: entry i scores prompt token i + 1

    @staticmethod
    def from_chunks(chunks: list[GenerateChunk], attempts: int = 1) -> Completion:
        first, last = chunks[0], chunks[-1]
        return Completion(
            first.request_id,
            tuple(t for c in chunks for t in c.token_ids),
            "".join(c.text for c in chunks),
            last.finish_reason or "",
            tuple(lp for c in chunks for lp in c.logprobs),
            first.route,
            last.usage,
            attempts,
            last.migrations,
            first.prompt_logprobs,
        )


@dataclass(frozen=True)
class ModelInfo:
    model_identity: str
    max_model_len: int
    vocab_size: int
    block_size: int
    hash_spec: str
    eos_token_ids: tuple[int, ...]
    has_tokenizer: bool


@dataclass(frozen=True)
class ClusterStatus:
    workers: tuple[dict, ...]
    inflight_requests: int
    requests_total: dict = field(default_factory=dict)
    routing_policy: str = ""
    prompt_tokens_total: int = 0
    cached_prompt_tokens_total: int = 0
    index_entries: int = 0
    migrations_total: dict = field(default_factory=dict)  # by cause


def chunk_from_proto(msg: pb.GenerateResponse) -> GenerateChunk:
    route = (
        Route(msg.route.prefill_worker, msg.route.decode_instance, msg.route.policy, msg.route.cached_prompt_tokens)
        if msg.HasField("route")
        else None
    )
    usage = (
        Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_prompt_tokens)
        if msg.HasField("usage")
        else None
    )
    return GenerateChunk(
        msg.request_id,
        tuple(msg.token_ids),
        msg.text,
        _token_logprobs(msg.logprobs),
        _FINISH.get(msg.finish_reason),
        route,
        usage,
        msg.migrations,
        _token_logprobs(msg.prompt_logprobs),
    )


def _token_logprobs(entries) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(entry.token_id, entry.logprob, tuple((t.token_id, t.logprob) for t in entry.top))
        for entry in entries
    )


def model_info_from_proto(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        msg.model_identity,
        msg.max_model_len,
        msg.vocab_size,
        msg.block_size,
        msg.hash_spec,
        tuple(msg.eos_token_ids),
        msg.has_tokenizer,
    )


def _plain(value):
    """A proto field's value as plain data: repeated messages become a tuple of dicts."""
    if hasattr(value, "DESCRIPTOR"):
        return {f.name: getattr(value, f.name) for f in value.DESCRIPTOR.fields}
    if isinstance(value, str | bytes | int | float | bool):
        return value
    return tuple(_plain(item) for item in value)


def status_from_proto(msg: pb.ClusterStatus) -> ClusterStatus:
    workers = tuple({f.name: _plain(getattr(w, f.name)) for f in w.DESCRIPTOR.fields} for w in msg.workers)
    return ClusterStatus(
        workers,
        msg.inflight_requests,
        dict(msg.requests_total),
        msg.routing_policy,
        msg.prompt_tokens_total,
        msg.cached_prompt_tokens_total,
        msg.index_entries,
        dict(msg.migrations_total),
    )
