"""OpenAI's `response_format` and vLLM's `structured_outputs` → one `StructuredOutputSpec`.

Both endpoints read them. `response_format`:

- `{"type": "text"}` (or left out): free text;
- `{"type": "json_object"}`: the output is one JSON object;
- `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ..., "description": ...}}`:
  the output is valid under `schema` (always held to it: `strict` false is accepted and enforced too).

`structured_outputs` (vLLM's extra field) is an object with exactly one of `json` (a schema, as an object
or JSON text), `json_object: true`, `regex`, `choice` (a list of strings) or `grammar` (EBNF, start rule
`root`). A request gives at most one of the two fields. Each error names the field as the client sent it
(`response_format.json_schema.schema`, `structured_outputs.regex`); a schema, regex or grammar the
grammar backend cannot compile is refused (400) naming the same field. `openapi_schemas` documents the
same tables for router.openai.openapi.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import NoReturn

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutputSpec
from router.validation import (
    MAX_STRUCTURED_CHOICES,
    MAX_STRUCTURED_OUTPUT_CHARS,
    ModelLimits,
    check_structured_output,
)

_NAME_CHARS = 64  # OpenAI's limit on json_schema.name


def structured_output(body: dict, limits: ModelLimits) -> StructuredOutputSpec | None:
    """The body's structured output, None for free text; InvalidRequestError naming the field."""
    response_format, structured = body.get("response_format"), body.get("structured_outputs")
    spec = _response_format(response_format)
    if structured is not None:
        if spec is not None:
            _fail("structured_outputs", "cannot be combined with a json response_format (send one of them)")
        spec = _structured_outputs(structured)
    return None if spec is None else check_structured_output(spec, limits)


# ---- response_format --------------------------------------------------------------------------------
def _json_object(value: dict, field: str) -> StructuredOutputSpec:
    return StructuredOutputSpec("json_object", field=field)


def _json_schema(value: dict, field: str) -> StructuredOutputSpec:
    described = _object(value.get("json_schema"), f"{field}.json_schema")
    name = described.get("name")
    if not (isinstance(name, str) and 0 < len(name) <= _NAME_CHARS):
        _fail(f"{field}.json_schema.name", f"must be a string of 1-{_NAME_CHARS} characters")
    if described.get("strict") is not None and not isinstance(described["strict"], bool):
        _fail(f"{field}.json_schema.strict", "must be true or false")
    if described.get("description") is not None and not isinstance(described["description"], str):
        _fail(f"{field}.json_schema.description", "must be a string")
    schema = described.get("schema", {})  # OpenAI: a missing schema is the empty one (any JSON)
    return _schema(schema, f"{field}.json_schema.schema")


# response_format.type -> its spec (None: free text).
RESPONSE_FORMATS: dict[str, Callable[[dict, str], StructuredOutputSpec] | None] = {
    "text": None,
    "json_object": _json_object,
    "json_schema": _json_schema,
}


def _response_format(value) -> StructuredOutputSpec | None:
    if value is None:
        return None
    value = _object(value, "response_format")
    kind = value.get("type", "text")
    if not isinstance(kind, str) or kind not in RESPONSE_FORMATS:  # a list or object is unhashable
        _fail("response_format.type", f"must be one of {list(RESPONSE_FORMATS)}")
    build = RESPONSE_FORMATS[kind]
    return None if build is None else build(value, "response_format")


# ---- structured_outputs -----------------------------------------------------------------------------
def _json(value, field: str) -> StructuredOutputSpec:
    if isinstance(value, str):
        if len(value) > MAX_STRUCTURED_OUTPUT_CHARS:
            _fail(field, f"at most {MAX_STRUCTURED_OUTPUT_CHARS} characters")
        try:
            value = json.loads(value)
        except ValueError:
            _fail(field, "must be a JSON schema (an object, or JSON text of one)")
    return _schema(value, field)


def _json_object_flag(value, field: str) -> StructuredOutputSpec:
    if value is not True:
        _fail(field, "must be true when given")
    return StructuredOutputSpec("json_object", field=field)


def _text(kind: str) -> Callable[[object, str], StructuredOutputSpec]:
    def build(value, field: str) -> StructuredOutputSpec:
        if not (isinstance(value, str) and value):
            _fail(field, f"must be a non-empty {kind} string")
        return StructuredOutputSpec(kind, value, field=field)

    return build


def _choice(value, field: str) -> StructuredOutputSpec:
    if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        _fail(field, "must be a non-empty list of non-empty strings")
    return StructuredOutputSpec("choice", choices=tuple(value), field=field)


# structured_outputs key -> its spec.
STRUCTURED_OUTPUT_KEYS: dict[str, Callable[[object, str], StructuredOutputSpec]] = {
    "json": _json,
    "json_object": _json_object_flag,
    "regex": _text("regex"),
    "choice": _choice,
    "grammar": _text("grammar"),
}


def _structured_outputs(value) -> StructuredOutputSpec:
    value = _object(value, "structured_outputs")
    unknown = sorted(key for key in value if key not in STRUCTURED_OUTPUT_KEYS)
    if unknown:
        _fail(f"structured_outputs.{unknown[0]}", f"is not supported; known: {list(STRUCTURED_OUTPUT_KEYS)}")
    if len(value) != 1:  # a key given as null counts: the object names one kind
        _fail("structured_outputs", f"give exactly one of {list(STRUCTURED_OUTPUT_KEYS)}")
    [key] = value
    return STRUCTURED_OUTPUT_KEYS[key](value[key], f"structured_outputs.{key}")


# ---- shared -----------------------------------------------------------------------------------------
def _schema(schema, field: str) -> StructuredOutputSpec:
    if not isinstance(schema, (dict, bool)):
        _fail(field, "must be a JSON schema (an object)")
    return StructuredOutputSpec.json_schema(schema, field=field)


def _object(value, field: str) -> dict:
    if not isinstance(value, dict):
        _fail(field, "must be an object")
    return value


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(field, message)


def openapi_schemas() -> dict[str, dict]:
    """The two fields' request schemas, for router.openai.openapi."""
    text = {"type": "string", "minLength": 1, "maxLength": MAX_STRUCTURED_OUTPUT_CHARS}
    schema = {"type": ["object", "boolean"], "description": "a JSON schema"}
    json_schema = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": _NAME_CHARS},
            "schema": schema,
            "strict": {"type": ["boolean", "null"]},
            "description": {"type": ["string", "null"]},
        },
    }
    formats = [
        {"type": "object", "properties": {"type": {"const": "text"}}},
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {"type": {"const": "json_schema"}, "json_schema": json_schema},
        },
    ]
    choices = {
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_STRUCTURED_CHOICES,
        "items": {"type": "string", "minLength": 1, "maxLength": MAX_STRUCTURED_OUTPUT_CHARS},
    }
    one_of = {
        "json": {"anyOf": [schema, text]},
        "json_object": {"const": True},
        "regex": text,
        "choice": choices,
        "grammar": text,
    }
    return {
        "response_format": {
            "anyOf": [{"type": "null"}, *formats],
            "description": "text, json_object, or json_schema (held to the schema whatever strict says)",
        },
        "structured_outputs": {
            "anyOf": [
                {"type": "null"},
                *(
                    {
                        "type": "object",
                        "required": [key],
                        "properties": {key: one_of[key]},
                        "additionalProperties": False,
                    }
                    for key in STRUCTURED_OUTPUT_KEYS
                ),
            ],
            "description": "vLLM's structured outputs: exactly one of json, json_object, regex, choice, grammar",
        },
    }


# For router.openai.openapi's x-splitserve-server-rules: what the schemas above cannot state.
_SHARED_RULE = "needs the model's tokenizer; not with structured_outputs or (chat) tool_choice required or named"
SERVER_RULES = {
    "response_format": f"json_schema.schema compiles into a grammar; {_SHARED_RULE}",
    "structured_outputs": "the schema, regex or grammar compiles; json given as text parses to a schema; "
    f"choice's strings total at most {MAX_STRUCTURED_OUTPUT_CHARS} characters; {_SHARED_RULE}",
}
