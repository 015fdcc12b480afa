"""Client request → domain `RouterRequest`, validating every field once; errors name the field.

The rules are front-independent functions that take the name the calling front gives each field:
the gRPC front (`parse_request`, here) names the proto's paths (`sampling.temperature`,
`slo.ttft_ms`, `token_ids`, `text`, `priority`, `tenant`, `request_id`); the OpenAI HTTP front
(`router.openai.parse`) names its JSON fields (`temperature`, `prompt`, `max_completion_tokens`).
Limits that depend on the model (vocabulary, context length) are checked here too, with the limit
stated, so that a bad request never reaches a worker.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeGuard

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from engine.structured.spec import StructuredOutputSpec
from splitserve_client.protocol import splitserve_v1_pb2 as pb
from splitserve_client.sdk_types import SENT_AT_KEY

MAX_PRIORITY = 1000
MAX_TENANT_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# A structured output's schema / regex / grammar text, and its choices: bounded so that compiling one is
# bounded too (a 50-property schema is about 2 KB).
MAX_STRUCTURED_OUTPUT_CHARS = 64 * 1024
MAX_STRUCTURED_CHOICES = 256
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


# Sampling fields read per request: (name, has presence), from the descriptor once at import; the
# structured-output oneof is read on its own (`_structured_output`).
_SAMPLING_FIELDS = tuple(
    (f.name, f.has_presence)
    for f in pb.SamplingParams.DESCRIPTOR.fields
    if f.containing_oneof is None or f.containing_oneof.name != "structured_output"
)


# ---- The rules every front applies (gRPC here, OpenAI HTTP in router.openai). Each takes the name the
# ---- front gives the field, so that an error names the field as that front's client sent it.


def check_request_id(request_id: str, field: str = "request_id") -> str:
    if not isinstance(request_id, str) or _REQUEST_ID.fullmatch(request_id) is None:
        _fail(field, "must be 1-128 printable ASCII characters without spaces")
    return request_id


def check_priority(priority, field: str = "priority") -> int:
    if not (_is_int(priority) and -MAX_PRIORITY <= priority <= MAX_PRIORITY):
        _fail(field, f"must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    return priority


def check_tenant(tenant, field: str = "tenant") -> str:
    if not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS:
        _fail(field, f"must be a string of at most {MAX_TENANT_CHARS} characters")
    return tenant


def check_slo_ms(value, field: str) -> float | None:
    """An SLO in milliseconds; None or 0 means unset (the priority class's default)."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        _fail(field, "must be a finite number of milliseconds > 0")
    return float(value)


def sampling_params(values: dict, limits: ModelLimits, prefix: str = "", names: dict | None = None) -> SamplingParams:
    """`SamplingParams(**values)` with the model's limits checked too; a bad value's error names the
    field as `prefix + names.get(field, field)`."""

    def field(name: str) -> str:
        return prefix + (names or {}).get(name, name)

    stop = values["stop"] = _as_tuple(values.get("stop", ()), field("stop"))
    stop_token_ids = values["stop_token_ids"] = _as_tuple(values.get("stop_token_ids", ()), field("stop_token_ids"))
    if len(stop) > MAX_STOP_STRINGS:
        _fail(field("stop"), f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not isinstance(s, str) or len(s) > MAX_STOP_CHARS for s in stop):
        _fail(field("stop"), f"each stop string is a string of at most {MAX_STOP_CHARS} characters")
    if stop and not limits.has_tokenizer:
        _fail(field("stop"), "the served model has no tokenizer")
    if not all(_is_int(t) for t in stop_token_ids):
        _fail(field("stop_token_ids"), "every item must be an integer token id")
    if stop_token_ids and (min(stop_token_ids) < 0 or max(stop_token_ids) >= limits.vocab_size):
        bad = [t for t in stop_token_ids if not 0 <= t < limits.vocab_size]
        _fail(field("stop_token_ids"), f"{bad[:5]} outside the vocabulary [0, {limits.vocab_size})")
    if "logit_bias" in values:
        values["logit_bias"] = _logit_bias(values["logit_bias"], limits, field("logit_bias"))
    if values.get("structured_output") is not None:
        check_structured_output(values["structured_output"], limits)
    max_tokens = values.get("max_tokens")
    if _is_int(max_tokens) and not 1 <= max_tokens <= limits.max_model_len - 1:
        _fail(
            field("max_tokens"),
            f"must be in [1, {limits.max_model_len - 1}] (the model's context length is {limits.max_model_len} tokens)",
        )
    try:
        return SamplingParams(**values)
    except InvalidRequestError as err:
        raise InvalidRequestError(field(err.field), err.reason) from None


def _logit_bias(raw, limits: ModelLimits, field: str) -> dict[int, float]:
    """Token id -> bias, from the proto's map (integer keys) or OpenAI's JSON object (keys are the ids
    written as decimal strings); ids checked against the vocabulary, biases by SamplingParams."""
    if not hasattr(raw, "items"):
        _fail(field, "must be an object mapping token ids to biases in [-100, 100]")
    if len(raw) > MAX_LOGIT_BIAS:
        _fail(field, f"has {len(raw)} tokens; at most {MAX_LOGIT_BIAS}")
    out: dict[int, float] = {}
    for key, bias in raw.items():
        token = key if _is_int(key) else int(key) if isinstance(key, str) and key.isdecimal() else None
        if token is None or not 0 <= token < limits.vocab_size:
            _fail(field, f"key {key!r} is not a token id in the vocabulary [0, {limits.vocab_size})")
        if token in out:
            _fail(field, f"names token {token} twice")
        out[token] = bias
    return out


def text_prompt(text, limits: ModelLimits, tokenize, field: str) -> tuple[int, ...]:
    """The tokens of a text prompt (`tokenize(text) -> list[int]`), checked against the model."""
    if not isinstance(text, str) or not text:
        _fail(field, "must be a non-empty string")
    if not limits.has_tokenizer:
        _fail(field, "the served model has no tokenizer; send token ids")
    if len(text) > 64 * limits.max_model_len:
        _fail(field, f"is far longer than the model's limit of {limits.max_model_len} tokens")
    tokens = tuple(tokenize(text))
    if not tokens:
        _fail(field, "tokenizes to no tokens")
    return check_prompt_length(tokens, limits, field)


def token_prompt(tokens: tuple[int, ...], limits: ModelLimits, field: str) -> tuple[int, ...]:
    """Token ids (integers: the front checks types), each in the vocabulary."""
    if not tokens:
        _fail(field, "is empty; at least one token is required")
    if min(tokens) < 0 or max(tokens) >= limits.vocab_size:  # in C; the index is looked for only on failure
        bad = next(i for i, t in enumerate(tokens) if not 0 <= t < limits.vocab_size)
        _fail(field, f"token {tokens[bad]} at index {bad} is outside the vocabulary [0, {limits.vocab_size})")
    return check_prompt_length(tokens, limits, field)


def check_prompt_length(tokens: tuple[int, ...], limits: ModelLimits, field: str) -> tuple[int, ...]:
    if len(tokens) >= limits.max_model_len:
        _fail(
            field,
            f"prompt has {len(tokens)} tokens; the model's limit is {limits.max_model_len} tokens "
            "including at least one generated",
        )
    return tokens


# ---- The gRPC front: proto message -> RouterRequest, errors naming the proto's field paths.


def parse_request(msg: pb.GenerateRequest, limits: ModelLimits, tokenize) -> RouterRequest:
    """Validates `msg`; `tokenize(text) -> list[int]` is called for text prompts only."""
    request_id = check_request_id(msg.request_id or uuid.uuid4().hex)
    check_priority(msg.priority)
    check_tenant(msg.tenant)
    ttft_ms, tpot_ms = _slo(msg)
    params = parse_sampling(msg.sampling, limits)
    text, tokens = _prompt(msg, limits, tokenize)
    return_text = msg.return_text if msg.HasField("return_text") else text is not None
    if return_text and not limits.has_tokenizer:
        _fail("return_text", "the served model has no tokenizer")
    return RouterRequest(request_id, tokens, params, msg.priority, msg.tenant, ttft_ms, tpot_ms, return_text, text)


def parse_sampling(msg: pb.SamplingParams, limits: ModelLimits) -> SamplingParams:
    values = {
        name: getattr(msg, name) for name, has_presence in _SAMPLING_FIELDS if not has_presence or msg.HasField(name)
    }
    kind = msg.WhichOneof("structured_output")
    if kind is not None:
        values["structured_output"] = _STRUCTURED_FROM_PROTO[kind](getattr(msg, kind), f"sampling.{kind}")
    return sampling_params(values, limits, "sampling.")


def check_structured_output(spec: StructuredOutputSpec, limits: ModelLimits) -> StructuredOutputSpec:
    """Bounds every front applies to a structured output (compiling it is the engine's check)."""
    if not limits.has_tokenizer:
        _fail(spec.field, "structured outputs need the served model's tokenizer, and it has none")
    if len(spec.value) > MAX_STRUCTURED_OUTPUT_CHARS:
        _fail(spec.field, f"at most {MAX_STRUCTURED_OUTPUT_CHARS} characters")
    if len(spec.choices) > MAX_STRUCTURED_CHOICES or sum(map(len, spec.choices)) > MAX_STRUCTURED_OUTPUT_CHARS:
        _fail(
            spec.field, f"at most {MAX_STRUCTURED_CHOICES} choices of {MAX_STRUCTURED_OUTPUT_CHARS} characters in all"
        )
    return spec


def json_schema_text(text: str, field: str) -> StructuredOutputSpec:
    """A JSON schema given as JSON text (gRPC's `json_schema`)."""
    if len(text) > MAX_STRUCTURED_OUTPUT_CHARS:
        _fail(field, f"at most {MAX_STRUCTURED_OUTPUT_CHARS} characters")
    try:
        schema = json.loads(text)
    except ValueError as error:
        _fail(field, f"must be a JSON schema as JSON text ({error})")
    return StructuredOutputSpec.json_schema(schema, field=field)


def _json_object(value: bool, field: str) -> StructuredOutputSpec:
    if value is not True:
        _fail(field, "must be true when set (leave the field unset for free text)")
    return StructuredOutputSpec("json_object", field=field)


# The structured_output oneof's fields: (its value, the field's name) -> the spec.
_STRUCTURED_FROM_PROTO: dict[str, Callable[[Any, str], StructuredOutputSpec]] = {
    "json_schema": json_schema_text,
    "json_object": _json_object,
    "regex": lambda value, field: StructuredOutputSpec("regex", value, field=field),
    "choice": lambda value, field: StructuredOutputSpec("choice", choices=tuple(value.choices), field=field),
    "grammar": lambda value, field: StructuredOutputSpec("grammar", value, field=field),
}


def _slo(msg: pb.GenerateRequest) -> tuple[float | None, float | None]:
    if not msg.HasField("slo"):
        return None, None
    ttft_ms, tpot_ms = (
        check_slo_ms(getattr(msg.slo, name) if msg.slo.HasField(name) else None, f"slo.{name}")
        for name in ("ttft_ms", "tpot_ms")
    )
    return ttft_ms, tpot_ms


def _prompt(msg: pb.GenerateRequest, limits: ModelLimits, tokenize) -> tuple[str | None, tuple[int, ...]]:
    kind = msg.WhichOneof("prompt")
    if kind is None:
        _fail("prompt", "set either text or token_ids")
    if kind == "text":
        return msg.text, text_prompt(msg.text, limits, tokenize, "text")
    return None, token_prompt(tuple(msg.token_ids.ids), limits, "token_ids")


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


def _is_int(value) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_tuple(values, field: str) -> tuple:
    if values is None:
        return ()
    if isinstance(values, str):
        return (values,)
    if not isinstance(values, (list, tuple)) and not hasattr(values, "__len__"):
        _fail(field, "must be a list")
    return tuple(values)


def _fail(field: str, message: str) -> NoReturn:
    """Raises; callers test first so that messages are formatted only for bad requests."""
    raise InvalidRequestError(field, message)
