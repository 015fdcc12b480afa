"""Proto request → domain request, validating every field once; errors name the proto field.

Field names in errors are the proto's paths (`sampling.temperature`, `slo.ttft_ms`, `token_ids`,
`text`, `priority`, `tenant`, `request_id`), so a client can map them straight back to its message.
Limits that depend on the model (vocabulary, context length) are checked here too, with the limit
stated, so that a bad request never reaches a worker.
"""
from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import NoReturn

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from router.protocol import splitserve_v1_pb2 as pb
from router.sdk_types import SENT_AT_KEY

MAX_PRIORITY = 1000
MAX_TENANT_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# A client-reported wait longer than this is taken for clock skew between client and router, not waiting.
MAX_CLIENT_WAIT_S = 60.0
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


# Sampling fields read per request: (name, has presence), from the descriptor once at import.
_SAMPLING_FIELDS = tuple((f.name, f.has_presence) for f in pb.SamplingParams.DESCRIPTOR.fields)


def parse_request(msg: pb.GenerateRequest, limits: ModelLimits, tokenize) -> RouterRequest:
    """Validates `msg`; `tokenize(text) -> list[int]` is called for text prompts only."""
    request_id = msg.request_id or uuid.uuid4().hex
    if _REQUEST_ID.fullmatch(request_id) is None:
        _fail("request_id", "must be 1-128 printable ASCII characters without spaces")
    if not -MAX_PRIORITY <= msg.priority <= MAX_PRIORITY:
        _fail("priority", f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    if len(msg.tenant) > MAX_TENANT_CHARS:
        _fail("tenant", f"must be at most {MAX_TENANT_CHARS} characters")
    ttft_ms, tpot_ms = _slo(msg)
    params = parse_sampling(msg.sampling, limits)
    text, tokens = _prompt(msg, limits, tokenize)
    return_text = msg.return_text if msg.HasField("return_text") else text is not None
    if return_text and not limits.has_tokenizer:
        _fail("return_text", "the served model has no tokenizer")
    if params.stop and not limits.has_tokenizer:
        _fail("sampling.stop", "the served model has no tokenizer")
    return RouterRequest(request_id, tokens, params, msg.priority, msg.tenant, ttft_ms, tpot_ms, return_text, text)


def parse_sampling(msg: pb.SamplingParams, limits: ModelLimits) -> SamplingParams:
    values = {name: getattr(msg, name) for name, has_presence in _SAMPLING_FIELDS
              if not has_presence or msg.HasField(name)}
    stop = values["stop"] = tuple(values.get("stop", ()))
    stop_token_ids = values["stop_token_ids"] = tuple(values.get("stop_token_ids", ()))
    if len(stop) > MAX_STOP_STRINGS:
        _fail("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        _fail("sampling.stop", f"each stop string is at most {MAX_STOP_CHARS} characters")
    if stop_token_ids and (min(stop_token_ids) < 0 or max(stop_token_ids) >= limits.vocab_size):
        bad = [t for t in stop_token_ids if not 0 <= t < limits.vocab_size]
        _fail("sampling.stop_token_ids", f"{bad[:5]} outside the vocabulary [0, {limits.vocab_size})")
    if "max_tokens" in values and not 1 <= values["max_tokens"] <= limits.max_model_len - 1:
        _fail("sampling.max_tokens", f"must be in [1, {limits.max_model_len - 1}] (the model's context length "
                                     f"is {limits.max_model_len} tokens)")
    try:
        return SamplingParams(**values)
    except InvalidRequestError as err:
        raise InvalidRequestError(f"sampling.{err.field}", err.reason) from None


def _slo(msg: pb.GenerateRequest) -> tuple[float | None, float | None]:
    if not msg.HasField("slo"):
        return None, None
    out = []
    for name in ("ttft_ms", "tpot_ms"):
        if msg.slo.HasField(name) and getattr(msg.slo, name) != 0:
            value = getattr(msg.slo, name)
            if not (math.isfinite(value) and value > 0):
                _fail(f"slo.{name}", "must be a finite number of milliseconds > 0")
            out.append(value)
        else:
            out.append(None)
    return out[0], out[1]


def _prompt(msg: pb.GenerateRequest, limits: ModelLimits, tokenize) -> tuple[str | None, tuple[int, ...]]:
    kind = msg.WhichOneof("prompt")
    if kind is None:
        _fail("prompt", "set either text or token_ids")
    if kind == "text":
        if not msg.text:
            _fail("text", "is empty")
        if not limits.has_tokenizer:
            _fail("text", "the served model has no tokenizer; send token_ids")
        if len(msg.text) > 64 * limits.max_model_len:
            _fail("text", f"is far longer than the model's limit of {limits.max_model_len} tokens")
        text, tokens, field = msg.text, tuple(tokenize(msg.text)), "text"
        if not tokens:
            _fail("text", "tokenizes to no tokens")
    else:
        text, tokens, field = None, tuple(msg.token_ids.ids), "token_ids"
        if not tokens:
            _fail("token_ids", "is empty; at least one token is required")
        if min(tokens) < 0 or max(tokens) >= limits.vocab_size:  # in C; the index is looked for only on failure
            bad = next(i for i, t in enumerate(tokens) if not 0 <= t < limits.vocab_size)
            _fail("token_ids", f"token {tokens[bad]} at index {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if len(tokens) >= limits.max_model_len:
        _fail(field, f"prompt has {len(tokens)} tokens; the model's limit is {limits.max_model_len} tokens "
                     "including at least one generated")
    return text, tokens


def client_wait_s(metadata, now_us: int | None = None) -> float:
    """Seconds since the client sent the request, from its `SENT_AT_KEY` metadata (0 without it).

    A send time in the future (the client's clock ahead) counts as no wait; one more than
    `MAX_CLIENT_WAIT_S` ago counts as clock skew and no wait either, so that a client with a wrong
    clock is not rejected for time it never waited."""
    sent_at = next((value for key, value in metadata or () if key == SENT_AT_KEY), None)
    if sent_at is None:
        return 0.0
    if not (isinstance(sent_at, str) and sent_at.isascii() and sent_at.isdigit() and len(sent_at) <= 20):
        _fail(f"metadata {SENT_AT_KEY}", "must be the send time in whole microseconds since the Unix epoch")
    waited_s = ((time.time_ns() // 1000 if now_us is None else now_us) - int(sent_at)) / 1e6
    return waited_s if 0.0 < waited_s <= MAX_CLIENT_WAIT_S else 0.0


def _fail(field: str, message: str) -> NoReturn:
    """Raises; callers test first so that messages are formatted only for bad requests."""
    raise InvalidRequestError(field, message)
