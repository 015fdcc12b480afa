"""Proto request → domain request, validating every field once; errors name the proto field.

Field names in errors are the proto's paths (`sampling.temperature`, `slo.ttft_ms`, `token_ids`,
`text`, `priority`, `tenant`, `request_id`), so a client can map them straight back to its message.
Limits that depend on the model (vocabulary, context length) are checked here too, with the limit
stated, so that a bad request never reaches a worker.
"""
from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from router.protocol import splitserve_v1_pb2 as pb

MAX_PRIORITY = 1000
MAX_TENANT_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    has_tokenizer: bool


@dataclass(frozen=True)
class RouterRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int
    tenant: str
    ttft_ms: float | None
    tpot_ms: float | None
    return_text: bool
    prompt_text: str | None  # the text, when the prompt came as text (tokenized by the router)


def parse_request(msg: pb.GenerateRequest, limits: ModelLimits, tokenize) -> RouterRequest:
    """Validates `msg`; `tokenize(text) -> list[int]` is called for text prompts only."""
    request_id = msg.request_id or uuid.uuid4().hex
    _check(_REQUEST_ID.fullmatch(request_id) is not None, "request_id",
           "must be 1-128 printable ASCII characters without spaces")
    _check(-MAX_PRIORITY <= msg.priority <= MAX_PRIORITY, "priority", f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    _check(len(msg.tenant) <= MAX_TENANT_CHARS, "tenant", f"must be at most {MAX_TENANT_CHARS} characters")
    ttft_ms, tpot_ms = _slo(msg)
    params = parse_sampling(msg.sampling, limits)
    text, tokens = _prompt(msg, limits, tokenize)
    return_text = msg.return_text if msg.HasField("return_text") else text is not None
    _check(not return_text or limits.has_tokenizer, "return_text", "the served model has no tokenizer")
    _check(not params.stop or limits.has_tokenizer, "sampling.stop", "the served model has no tokenizer")
    return RouterRequest(request_id, tokens, params, msg.priority, msg.tenant, ttft_ms, tpot_ms, return_text, text)


def parse_sampling(msg: pb.SamplingParams, limits: ModelLimits) -> SamplingParams:
    values = {field.name: getattr(msg, field.name) for field in msg.DESCRIPTOR.fields
              if not field.has_presence or msg.HasField(field.name)}
    values["stop"] = tuple(values.get("stop", ()))
    values["stop_token_ids"] = tuple(values.get("stop_token_ids", ()))
    _check(len(values["stop"]) <= MAX_STOP_STRINGS, "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    _check(all(len(s) <= MAX_STOP_CHARS for s in values["stop"]), "sampling.stop",
           f"each stop string is at most {MAX_STOP_CHARS} characters")
    bad = [t for t in values["stop_token_ids"] if not 0 <= t < limits.vocab_size]
    _check(not bad, "sampling.stop_token_ids", f"{bad[:5]} outside the vocabulary [0, {limits.vocab_size})")
    if "max_tokens" in values:
        limit = limits.max_model_len - 1
        _check(1 <= values["max_tokens"] <= limit, "sampling.max_tokens",
               f"must be in [1, {limit}] (the model's context length is {limits.max_model_len} tokens)")
    try:
        return SamplingParams(**values)
    except InvalidRequestError as err:
        raise InvalidRequestError(f"sampling.{err.field}", err.reason) from None


def _slo(msg: pb.GenerateRequest) -> tuple[float | None, float | None]:
    out = []
    for name in ("ttft_ms", "tpot_ms"):
        if msg.HasField("slo") and msg.slo.HasField(name) and getattr(msg.slo, name) != 0:
            value = getattr(msg.slo, name)
            _check(math.isfinite(value) and value > 0, f"slo.{name}", "must be a finite number of milliseconds > 0")
            out.append(value)
        else:
            out.append(None)
    return out[0], out[1]


def _prompt(msg: pb.GenerateRequest, limits: ModelLimits, tokenize) -> tuple[str | None, tuple[int, ...]]:
    kind = msg.WhichOneof("prompt")
    _check(kind is not None, "prompt", "set either text or token_ids")
    if kind == "text":
        _check(bool(msg.text), "text", "is empty")
        _check(limits.has_tokenizer, "text", "the served model has no tokenizer; send token_ids")
        _check(len(msg.text) <= 64 * limits.max_model_len, "text",
               f"is far longer than the model's limit of {limits.max_model_len} tokens")
        text, tokens, field = msg.text, tuple(tokenize(msg.text)), "text"
        _check(bool(tokens), "text", "tokenizes to no tokens")
    else:
        text, tokens, field = None, tuple(msg.token_ids.ids), "token_ids"
        _check(bool(tokens), "token_ids", "is empty; at least one token is required")
        bad = next((i for i, t in enumerate(tokens) if not 0 <= t < limits.vocab_size), None)
        _check(bad is None, "token_ids", f"token {tokens[bad] if bad is not None else ''} at index {bad} is "
                                         f"outside the vocabulary [0, {limits.vocab_size})")
    _check(len(tokens) < limits.max_model_len, field,
           f"prompt has {len(tokens)} tokens; the model's limit is {limits.max_model_len} tokens "
           "including at least one generated")
    return text, tokens


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field, message)
