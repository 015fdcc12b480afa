"""The `openai` bench backend: streams `POST /v1/completions` to any OpenAI-compatible server (vLLM,
SGLang, TGI, Dynamo, splitserve's own HTTP front) with aiohttp, as `vllm bench serve` does.

Each planned request is sent as token ids (`prompt: [ids]`, so its length is exact on every server),
with `max_tokens`, `ignore_eos: true`, `stream: true`, `stream_options.include_usage` and, when set,
splitserve's SLO / priority / tenant fields (other servers ignore unknown fields). Timing, per
server-sent event:
- a chunk with content is one whose choice carries text or token ids; the first one is the TTFT;
- tokens per chunk: `len(token_ids)` when the server sends them (`return_token_ids`, vLLM's extra
  field; splitserve's front honours it), else one per chunk with text (marked inexact: the final
  `usage.completion_tokens` then sets the total, see `recorder`);
- the final chunk's usage gives completion tokens and `prompt_tokens_details.cached_tokens`.
The model's limits come from `GET /v1/models` (`max_model_len`; splitserve's card adds the
vocabulary), or from `--tokenizer DIR` for a server whose card does not state its vocabulary.
"""

from __future__ import annotations

import json
import ssl
import time
from typing import Self

import aiohttp

from loadtest.backends import BackendError, RequestError, RequestOptions, StreamEvent
from loadtest.plan import ModelLimits, PlannedRequest
from splitserve_client.channel import ClientTls
from splitserve_client.sdk_types import SENT_AT_KEY

# HTTP status → the gRPC status name summaries group by (the same table as the router's HTTP front).
_CODES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    409: "ALREADY_EXISTS",
    413: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# splitserve's error.code strings (router.openai.errors) → status names.
_ERROR_CODES = {
    "invalid_value": "INVALID_ARGUMENT",
    "overloaded": "RESOURCE_EXHAUSTED",
    "unavailable": "UNAVAILABLE",
    "deadline_exceeded": "DEADLINE_EXCEEDED",
    "internal_error": "INTERNAL",
}
DEFAULT_BLOCK_SIZE = 16  # only the trace workload reads it (tokens per trace block); a guess off splitserve


def status_name(status: int) -> str:
    return _CODES.get(status, f"HTTP_{status}")


class OpenAIBackend:
    path = "/v1/completions"  # the chat backend (loadtest.openai_chat_backend) posts to chat instead

    def __init__(
        self,
        target: str,
        token: str | None,
        timeout_s: float,
        model: str | None = None,
        tokenizer: str | None = None,
        tls: ClientTls = ClientTls(),
    ):
        self.base = target.rstrip("/").removesuffix("/v1")
        # https:// targets are verified against --tls-ca-file when given, else the system's roots.
        self.ssl = (
            ssl.create_default_context(cadata=tls.root_certificates.decode())
            if tls.root_certificates is not None
            else None
        )
        self.model, self.tokenizer_dir = model, tokenizer
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        # No connection limit: the driver's --max-concurrency is the only cap on open streams.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=self.ssl or True), headers=self.headers
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()

    def _open(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("use the backend as `async with OpenAIBackend(...)`")
        return self.session

    async def model_limits(self) -> ModelLimits:
        try:
            async with self._open().get(f"{self.base}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as reply:
                if reply.status != 200:
                    raise BackendError(f"GET {self.base}/v1/models answered {reply.status}: {await reply.text()}")
                cards = (await reply.json()).get("data") or []
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            raise BackendError(f"cannot list the models at {self.base}: {type(err).__name__}: {err}") from None
        card = next((c for c in cards if c.get("id") == self.model), None) if self.model else (cards or [None])[0]
        if card is None:
            raise BackendError(f"{self.base} serves no model {self.model!r}: {[c.get('id') for c in cards]}")
        self.model = card["id"]
        try:
            return self._limits(card)
        except ValueError as err:
            raise BackendError(f"the model {self.model!r} at {self.base} has unusable limits: {err}") from None

    def _limits(self, card: dict) -> ModelLimits:
        ours = card.get("splitserve") or {}
        max_model_len = card.get("max_model_len")
        if ours:
            if max_model_len is None:
                raise ValueError("its card has no max_model_len")
            return ModelLimits(max_model_len, ours["vocab_size"], ours["block_size"], tuple(ours["eos_token_ids"]))
        if self.tokenizer_dir is None:
            raise ValueError("its card does not state the vocabulary: pass --tokenizer DIR (the model's tokenizer)")
        from engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_dir)
        eos = tokenizer.eos_token_id
        return ModelLimits(
            max_model_len or tokenizer.model_max_length,
            len(tokenizer),
            DEFAULT_BLOCK_SIZE,
            () if eos is None else (eos,),
        )

    def _body(self, planned: PlannedRequest, options: RequestOptions) -> dict:
        body = {
            "model": self.model,
            "prompt": list(planned.prompt_token_ids),
            "max_tokens": planned.max_tokens,
            "temperature": options.temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        extras = {
            "ttft_ms": planned.slo.ttft_ms,
            "tpot_ms": planned.slo.tpot_ms,
            # The plan's priority is splitserve's (higher first); the HTTP field is vLLM's (lower first).
            "priority": -planned.priority or None,
            "tenant": planned.tenant or None,
        }
        body.update({k: v for k, v in extras.items() if v is not None})
        return body

    async def stream(self, planned: PlannedRequest, options: RequestOptions):
        headers = {"X-Request-Id": options.request_id, SENT_AT_KEY: str(time.time_ns() // 1000)}
        try:
            async with self._open().post(
                f"{self.base}{self.path}",
                json=self._body(planned, options),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=options.timeout_s),
            ) as reply:
                if reply.status != 200:
                    raise RequestError(status_name(reply.status), _error_message(await reply.text()))
                async for line in reply.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    event = _event(json.loads(data))
                    if event is not None:
                        yield event
        except aiohttp.ClientError as err:
            raise RequestError("UNAVAILABLE", f"{type(err).__name__}: {err}") from None
        except TimeoutError:
            raise RequestError("DEADLINE_EXCEEDED", f"no answer within {options.timeout_s} s") from None


def _event(chunk: dict) -> StreamEvent | None:
    if chunk.get("error"):
        error = chunk["error"]
        raise RequestError(_code_of(error), error.get("message", str(error)))
    usage = chunk.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") if usage else None
    completion = usage.get("completion_tokens") if usage else None
    choices = chunk.get("choices") or []
    if not choices:
        return StreamEvent(0, cached, completion) if usage else None
    choice = choices[0]
    token_ids = choice.get("token_ids")
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    if token_ids is not None:
        return StreamEvent(len(token_ids), cached, completion, choice.get("finish_reason"), tuple(token_ids))
    return StreamEvent(1 if text else 0, cached, completion, choice.get("finish_reason"), exact=False)


def _code_of(error: dict) -> str:
    """An error event's status name: numeric codes are HTTP statuses (vLLM), strings splitserve's codes."""
    code = error.get("code")
    if isinstance(code, int):
        return status_name(code)
    return _ERROR_CODES.get(str(code), "INTERNAL")  # None or unknown: INTERNAL


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]
