"""The splitserve client SDK: sync `Client` and asyncio `AsyncClient` over the router's gRPC API.

Needs only grpcio and protobuf. Retries are limited to where they are safe: a call that failed with
UNAVAILABLE before any token arrived is retried (same request id, exponential backoff with jitter);
nothing is retried once a token was delivered, and no other status is retried.

    with Client("127.0.0.1:50051") as client:
        print(client.generate("Hello", max_tokens=16, temperature=0).text)
        for chunk in client.generate_stream([1, 2, 3], max_tokens=8):
            print(chunk.token_ids, chunk.text)
"""
from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from router.protocol import splitserve_v1_pb2 as pb
from router.protocol import splitserve_v1_pb2_grpc as pb_grpc
from router.sdk_types import (SENT_AT_KEY, Completion, GenerateChunk, SplitserveError, Unavailable,
                              chunk_from_proto, error_from_rpc, model_info_from_proto, status_from_proto)

_SAMPLING_FIELDS = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
_SLO_FIELDS = {"ttft_ms", "tpot_ms"}
_REQUEST_FIELDS = {"priority", "tenant", "request_id", "return_text"}


def build_request(prompt: str | Sequence[int], **options) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt and keyword options (sampling fields, ttft_ms / tpot_ms,
    priority, tenant, request_id, return_text). Unknown options raise TypeError naming them."""
    unknown = set(options) - _SAMPLING_FIELDS - _SLO_FIELDS - _REQUEST_FIELDS
    if unknown:
        raise TypeError(f"unknown generate option(s) {sorted(unknown)}")
    request = pb.GenerateRequest(**{k: v for k, v in options.items() if k in _REQUEST_FIELDS and v is not None})
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    sampling = {k: v for k, v in options.items() if k in _SAMPLING_FIELDS and v is not None}
    request.sampling.CopyFrom(pb.SamplingParams(**sampling))
    slo = {k: v for k, v in options.items() if k in _SLO_FIELDS and v is not None}
    if slo:
        request.slo.CopyFrom(pb.Slo(**slo))
    if not request.request_id:  # chosen here so that a retry is recognisably the same request
        request.request_id = uuid.uuid4().hex
    return request


class _Base:
    def __init__(self, target: str, *, token: str | None = None, timeout_s: float | None = 600.0,
                 max_retries: int = 3, backoff_s: float = 0.1):
        self.target, self.timeout_s = target, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def _generate_metadata(self) -> tuple:
        # Stamped once per request, not per attempt: the caller's TTFT started with the first attempt.
        return self._metadata + ((SENT_AT_KEY, str(time.time_ns() // 1000)),)

    def _delay_s(self, attempt: int) -> float:
        return self.backoff_s * (2 ** attempt) * (0.5 + random.random())


class Client(_Base):
    """Blocking client; one channel, safe to share between threads."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.RouterStub(self._channel)

    def generate_stream(self, prompt: str | Sequence[int], *, timeout_s: float | None = None,
                        **options) -> Iterator[GenerateChunk]:
        request = build_request(prompt, **options)
        deadline_s = time.monotonic() + (timeout_s or self.timeout_s or 1e9)
        metadata = self._generate_metadata()
        for attempt in range(self.max_retries + 1):
            delivered = False
            call = self._stub.Generate(request, timeout=deadline_s - time.monotonic(), metadata=metadata)
            try:
                for message in call:
                    delivered = True
                    yield chunk_from_proto(message)
                return
            except grpc.RpcError as err:
                error = error_from_rpc(err)
                if delivered or not _retryable(error, attempt, self.max_retries):
                    raise error from None
            finally:
                call.cancel()  # no-op when the call ended; frees the server's stream when the caller stopped early
            time.sleep(min(self._delay_s(attempt), max(deadline_s - time.monotonic(), 0.0)))

    def generate(self, prompt: str | Sequence[int], **options) -> Completion:
        return Completion.from_chunks(list(self.generate_stream(prompt, **options)))

    def model_info(self, timeout_s: float = 10.0):
        return model_info_from_proto(self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout_s))

    def status(self, timeout_s: float = 10.0):
        return status_from_proto(self._unary(self._stub.GetClusterStatus, pb.GetClusterStatusRequest(), timeout_s))

    def _unary(self, method, request, timeout_s: float):
        for attempt in range(self.max_retries + 1):
            try:
                return method(request, timeout=timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:
                error = error_from_rpc(err)
                if not _retryable(error, attempt, self.max_retries):
                    raise error from None
            time.sleep(self._delay_s(attempt))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client; create and use it inside one event loop."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.RouterStub(self._channel)

    async def generate_stream(self, prompt: str | Sequence[int], *, timeout_s: float | None = None,
                              **options) -> AsyncIterator[GenerateChunk]:
        request = build_request(prompt, **options)
        deadline_s = time.monotonic() + (timeout_s or self.timeout_s or 1e9)
        metadata = self._generate_metadata()
        for attempt in range(self.max_retries + 1):
            delivered = False
            call = self._stub.Generate(request, timeout=deadline_s - time.monotonic(), metadata=metadata)
            try:
                async for message in call:
                    delivered = True
                    yield chunk_from_proto(message)
                return
            except grpc.RpcError as err:
                error = error_from_rpc(err)
                if delivered or not _retryable(error, attempt, self.max_retries):
                    raise error from None
            finally:
                call.cancel()  # no-op when the call ended; frees the server's stream when the caller stopped early
            await asyncio.sleep(min(self._delay_s(attempt), max(deadline_s - time.monotonic(), 0.0)))

    async def generate(self, prompt: str | Sequence[int], **options) -> Completion:
        return Completion.from_chunks([chunk async for chunk in self.generate_stream(prompt, **options)])

    async def model_info(self, timeout_s: float = 10.0):
        return model_info_from_proto(await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout_s))

    async def status(self, timeout_s: float = 10.0):
        return status_from_proto(await self._unary(self._stub.GetClusterStatus, pb.GetClusterStatusRequest(),
                                                   timeout_s))

    async def _unary(self, method, request, timeout_s: float):
        for attempt in range(self.max_retries + 1):
            try:
                return await method(request, timeout=timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:
                error = error_from_rpc(err)
                if not _retryable(error, attempt, self.max_retries):
                    raise error from None
            await asyncio.sleep(self._delay_s(attempt))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _retryable(error: SplitserveError, attempt: int, max_retries: int) -> bool:
    return isinstance(error, Unavailable) and attempt < max_retries
