"""What the load driver talks to: a backend per protocol, one registry (`--backend NAME`).

A backend is an async context manager that says what the served model allows (`model_limits`) and
streams one planned request (`stream`) as `StreamEvent`s: tokens that arrived, what the server
reported (cached prompt tokens, its own count of completion tokens) and the finish reason. A failure
raises `RequestError` with a status name, the gRPC one for both protocols (HTTP statuses are mapped:
429 → RESOURCE_EXHAUSTED, 504 → DEADLINE_EXCEEDED, ...), so that summaries group errors the same
way whatever the backend.

- `splitserve`: the SDK's `AsyncClient` over gRPC (`--target HOST:PORT` or `unix:PATH`).
- `openai`: any OpenAI-compatible server over HTTP (`--target http://HOST:PORT`), `loadtest.openai_backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from loadtest.plan import ModelLimits, PlannedRequest
from splitserve_client.channel import ClientTls
from splitserve_client.sdk_types import SplitserveError


class BackendError(Exception):
    """The backend cannot be used: server unreachable, model unknown, limits unusable."""


class RequestError(Exception):
    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code, self.reason = code, reason


@dataclass(frozen=True)
class StreamEvent:
    num_tokens: int  # output tokens this message carried
    cached_prompt_tokens: int | None = None
    completion_tokens: int | None = None  # the server's own count (usage), when it sends one
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()  # the tokens themselves, when the server sends them
    migrations: int = 0  # splitserve: times the router moved the request to other workers (final message)
    # False when num_tokens is a guess (an OpenAI server that sends text only: one token per chunk
    # with text); the server's completion_tokens then corrects the total (see `recorder`).
    exact: bool = True


@dataclass(frozen=True)
class RequestOptions:
    """Per request, beside the plan: what the driver sends with every request."""

    request_id: str
    temperature: float
    timeout_s: float


class GrpcBackend:
    """The splitserve router through the SDK (`splitserve_client.client.AsyncClient`)."""

    def __init__(self, target: str, token: str | None, timeout_s: float, tls: ClientTls = ClientTls(), **_):
        from splitserve_client.client import AsyncClient

        self.target = target
        self.client = AsyncClient(target, token=token, tls=tls, timeout_s=timeout_s)

    async def __aenter__(self) -> Self:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.__aexit__(*exc)

    async def model_limits(self) -> ModelLimits:
        try:
            info = await self.client.model_info()
        except SplitserveError as err:
            raise BackendError(f"cannot get the model's limits from {self.target}: {err}") from None
        try:
            return ModelLimits.from_model_info(info)
        except ValueError as err:
            raise BackendError(f"the router at {self.target} reports unusable model limits: {err}") from None

    async def stream(self, planned: PlannedRequest, options: RequestOptions):
        slo = planned.slo
        try:
            async for chunk in self.client.generate_stream(
                list(planned.prompt_token_ids),
                timeout_s=options.timeout_s,
                max_tokens=planned.max_tokens,
                ignore_eos=True,
                temperature=options.temperature,
                ttft_ms=slo.ttft_ms,
                tpot_ms=slo.tpot_ms,
                priority=planned.priority,
                tenant=planned.tenant or None,
                request_id=options.request_id,
            ):
                cached = (
                    chunk.usage.cached_prompt_tokens
                    if chunk.usage is not None
                    else (chunk.route.cached_prompt_tokens if chunk.route is not None else None)
                )
                completion = chunk.usage.completion_tokens if chunk.usage is not None else None
                yield StreamEvent(
                    len(chunk.token_ids),
                    cached,
                    completion,
                    chunk.finish_reason,
                    tuple(chunk.token_ids),
                    chunk.migrations,
                )
        except SplitserveError as err:
            raise RequestError(err.code.name, err.reason) from None


def _openai(**kwargs):
    from loadtest.openai_backend import OpenAIBackend

    return OpenAIBackend(**kwargs)


def _openai_chat(**kwargs):
    from loadtest.openai_chat_backend import OpenAIChatBackend

    return OpenAIChatBackend(**kwargs)


BACKENDS: dict[str, Callable[..., Any]] = {"splitserve": GrpcBackend, "openai": _openai, "openai-chat": _openai_chat}


def make_backend(name: str, **kwargs):
    """kwargs: target, token, timeout_s, tls (splitserve_client.channel.ClientTls), and for openai model / tokenizer."""
    if name not in BACKENDS:
        raise ValueError(f"--backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name](**kwargs)
