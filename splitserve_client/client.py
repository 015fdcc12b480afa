"""The splitserve client SDK: sync `Client` and asyncio `AsyncClient` over the router's gRPC API.

Needs only grpcio and protobuf. Retries are limited to where they are safe: a call that failed with
UNAVAILABLE before any token arrived is retried (same request id, exponential backoff with jitter);
nothing is retried once a token was delivered, and no other status is retried.

    with Client("127.0.0.1:50051") as client:
        print(client.generate("Hello", max_tokens=16, temperature=0).text)
        for chunk in client.generate_stream([1, 2, 3], max_tokens=8):
            print(chunk.token_ids, chunk.text)

Targets: HOST:PORT, [IPV6]:PORT, unix:PATH or a gRPC URI (`splitserve_client/channel.py`). TLS: pass
`root_certificates=` (PEM bytes of the CA; `tls=True` alone trusts the system's roots), for mutual TLS
also `certificate_chain=` and `private_key=`, and `tls_server_name=` to check the certificate
against another name than the target's host:

    ca = open("ca.pem", "rb").read()
    with Client("router.example.com:443", root_certificates=ca, token=token) as client: ...
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Self

import grpc

from splitserve_client.channel import ClientTls, check_target, connection_hint, open_channel
from splitserve_client.protocol import splitserve_v1_pb2 as pb
from splitserve_client.protocol import splitserve_v1_pb2_grpc as pb_grpc
from splitserve_client.sdk_types import (
    SENT_AT_KEY,
    Completion,
    GenerateChunk,
    SplitserveError,
    Unavailable,
    chunk_from_proto,
    error_from_rpc,
    model_info_from_proto,
    status_from_proto,
)

_SAMPLING_FIELDS = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
_SLO_FIELDS = {"ttft_ms", "tpot_ms"}
_REQUEST_FIELDS = {"priority", "tenant", "request_id", "return_text"}


def build_request(prompt: str | Sequence[int], **options) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt and keyword options (sampling fields, ttft_ms / tpot_ms,
    priority, tenant, request_id, return_text). Unknown options raise TypeError naming them. A
    structured output is one of `json_schema` (a dict or JSON text), `json_object=True`, `regex`,
    `choice` (a list of strings) or `grammar`."""
    unknown = set(options) - _SAMPLING_FIELDS - _SLO_FIELDS - _REQUEST_FIELDS
    if unknown:
        raise TypeError(f"unknown generate option(s) {sorted(unknown)}")
    request = pb.GenerateRequest(**{k: v for k, v in options.items() if k in _REQUEST_FIELDS and v is not None})
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    sampling = {k: v for k, v in options.items() if k in _SAMPLING_FIELDS and v is not None}
    # Structured outputs: a schema may be given parsed, and choices as a plain list of strings.
    if isinstance(sampling.get("json_schema"), (dict, bool)):
        sampling["json_schema"] = json.dumps(sampling["json_schema"])
    if isinstance(sampling.get("choice"), (list, tuple)):
        sampling["choice"] = pb.SamplingParams.Choices(choices=list(sampling["choice"]))
    request.sampling.CopyFrom(pb.SamplingParams(**sampling))
    slo = {k: v for k, v in options.items() if k in _SLO_FIELDS and v is not None}
    if slo:
        request.slo.CopyFrom(pb.Slo(**slo))
    if not request.request_id:  # chosen here so that a retry is recognisably the same request
        request.request_id = uuid.uuid4().hex
    return request


class _Base:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout_s: float | None = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.1,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        tls_server_name: str | None = None,
        tls: bool | ClientTls = False,
    ):
        self.target, self.timeout_s = check_target(target), timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.tls = _client_tls(tls, root_certificates, certificate_chain, private_key, tls_server_name)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if token and not self.tls.on and not _local(target):
            warnings.warn(
                f"sending the bearer token to {target} without TLS: anyone on the path can read it", stacklevel=3
            )

    def _channel(self, aio: bool):
        return open_channel(self.target, self.tls, aio=aio)

    def _error(self, err: grpc.RpcError) -> SplitserveError:
        """The typed error, with a hint where gRPC's words do not say what to do (TLS mismatches)."""
        error = error_from_rpc(err)
        hint = connection_hint(error.reason, self.tls) if isinstance(error, Unavailable) else ""
        return type(error)(error.code, f"{error.reason} ({hint})", error.field, error.retry_after_s) if hint else error

    def _generate_metadata(self) -> tuple:
        # Stamped once per request, not per attempt: the caller's TTFT started with the first attempt.
        return (*self._metadata, (SENT_AT_KEY, str(time.time_ns() // 1000)))

    def _delay_s(self, attempt: int) -> float:
        return self.backoff_s * (2**attempt) * (0.5 + random.random())


class Client(_Base):
    """Blocking client; one channel, safe to share between threads."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self._grpc_channel = self._channel(aio=False)
        self._stub = pb_grpc.RouterStub(self._grpc_channel)

    def generate_stream(
        self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **options
    ) -> Iterator[GenerateChunk]:
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
                error = self._error(err)
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
                error = self._error(err)
                if not _retryable(error, attempt, self.max_retries):
                    raise error from None
            time.sleep(self._delay_s(attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def close(self) -> None:
        self._grpc_channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client; create and use it inside one event loop."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self._grpc_channel = self._channel(aio=True)
        self._stub = pb_grpc.RouterStub(self._grpc_channel)

    async def generate_stream(
        self, prompt: str | Sequence[int], *, timeout_s: float | None = None, **options
    ) -> AsyncIterator[GenerateChunk]:
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
                error = self._error(err)
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
        return status_from_proto(
            await self._unary(self._stub.GetClusterStatus, pb.GetClusterStatusRequest(), timeout_s)
        )

    async def _unary(self, method, request, timeout_s: float):
        for attempt in range(self.max_retries + 1):
            try:
                return await method(request, timeout=timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:
                error = self._error(err)
                if not _retryable(error, attempt, self.max_retries):
                    raise error from None
            await asyncio.sleep(self._delay_s(attempt))
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def close(self) -> None:
        await self._grpc_channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _retryable(error: SplitserveError, attempt: int, max_retries: int) -> bool:
    return isinstance(error, Unavailable) and attempt < max_retries


def _client_tls(tls: bool | ClientTls, root_certificates, certificate_chain, private_key, server_name) -> ClientTls:
    if isinstance(tls, ClientTls):
        if any(v is not None for v in (root_certificates, certificate_chain, private_key, server_name)):
            raise TypeError("pass the TLS settings either as tls=ClientTls(...) or as keywords, not both")
        return tls
    return ClientTls(root_certificates, certificate_chain, private_key, server_name, enabled=bool(tls))


def _local(target: str) -> bool:
    """A unix socket or a loopback address: a token sent there never crosses a network."""
    host = target.rsplit(":", 1)[0].strip("[]")
    return target.startswith(("unix:", "unix-abstract:")) or host in ("localhost", "::1") or host.startswith("127.")
