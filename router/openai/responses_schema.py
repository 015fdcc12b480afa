"""`POST /v1/responses` in the OpenAPI document: its request body (the tables of
`router.openai.responses_parse`), the rules JSON Schema cannot state, the response object and the stream's
events (what `router.openai.responses` writes). `router.openai.openapi` places them in the document.
"""

from __future__ import annotations

from router.openai.chat_template import MAX_MESSAGES
from router.openai.responses_parse import (
    FORMAT_KEYS,
    IGNORED_STRINGS,
    ITEM_KEYS,
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    PASSED_FIELDS,
    REASONING_EFFORTS,
    REASONING_SUMMARIES,
    REFUSED_FIELDS,
    TEXT_PART_TYPES,
)
from router.openai.tools import _NAME, MAX_TOOLS, TOOL_CHOICES

_FLAG = {"type": ["boolean", "null"]}
_ANY: dict = {}  # read by nothing (an item's id and status, as an earlier response gave them)


def request_body(known: dict[str, dict], max_tokens: dict, text: dict) -> dict:
    """`known`: the schemas of chat's fields by name (the ones passed on as they are come from there);
    `max_tokens`: max_output_tokens's; `text`: a text prompt's."""
    missing = set(PASSED_FIELDS) - set(known)
    if missing:  # a field passed to chat is documented as chat documents it, or the router does not start
        raise RuntimeError(f"responses_parse.PASSED_FIELDS has undocumented fields: {sorted(missing)}")
    properties = {
        **{name: known[name] for name in PASSED_FIELDS},
        **{
            name: {"enum": [None, *neutral], "description": f"not supported: {why}"}
            for name, (neutral, why) in REFUSED_FIELDS.items()
        },
        **{name: {"type": ["string", "null"], "description": "ignored"} for name in IGNORED_STRINGS},
        "chat_template_kwargs": known["chat_template_kwargs"],
        "stream_options": {
            "type": ["object", "null"],
            "additionalProperties": False,
            "properties": {"include_obfuscation": {**_FLAG, "description": "ignored"}},
        },
        "instructions": {"type": ["string", "null"], "description": "a system message before the input"},
        "input": {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": _item()}]},
        "max_output_tokens": {**max_tokens, "description": "default: the tokens left in the context"},
        "metadata": {
            "type": ["object", "null"],
            "maxProperties": MAX_METADATA_PAIRS,
            "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
            "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS},
            "description": "repeated in the response",
        },
        "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": _function_tool()},
        "tool_choice": {
            "anyOf": [
                {"enum": [None, *TOOL_CHOICES]},
                _strict_object({"type": {"const": "function"}, "name": {"type": "string"}}, ["type", "name"]),
            ],
            "description": "auto (the default with tools), none, required, or a named function",
        },
        "text": {
            "type": ["object", "null"],
            "additionalProperties": False,
            "properties": {"format": _text_format(), "verbosity": {"enum": [None, "medium"]}},
        },
        "reasoning": {
            "type": ["object", "null"],
            "additionalProperties": False,
            "properties": {
                "effort": {"enum": [None, *REASONING_EFFORTS], "description": "the template's reasoning_effort"},
                "summary": {"enum": [None, *REASONING_SUMMARIES]},
                "generate_summary": {"enum": [None, *REASONING_SUMMARIES]},
            },
        },
    }
    return {"type": "object", "required": ["input"], "additionalProperties": False, "properties": properties}


def server_rules(chat_rules: dict[str, str]) -> dict[str, str]:
    """What the parser refuses beyond the schema, by field (chat's rules under the Responses' names)."""
    return {
        "input": chat_rules["messages"],
        "tools": chat_rules["tools"],
        "tool_choice": chat_rules["tool_choice"],
        "text": "a json_schema format's schema compiles",
        "chat_template": chat_rules["chat_template"],
        "chat_template_kwargs": chat_rules["chat_template_kwargs"],
    }


def _strict_object(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "required": required, "additionalProperties": False, "properties": properties}


def _item() -> dict:
    part = _strict_object(
        {"type": {"enum": list(TEXT_PART_TYPES)}, "text": {"type": "string"}, "annotations": _ANY, "logprobs": _ANY},
        ["type", "text"],
    )
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    shapes: dict[str, tuple[dict, list[str]]] = {
        "message": (
            {"type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
             "content": content},
            ["role", "content"],
        ),
        "function_call": (
            {"type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string"},
             "arguments": {"type": "string", "description": "the call's arguments as JSON text"}},
            ["type", "call_id", "name", "arguments"],
        ),
        "function_call_output": (
            {"type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": content},
            ["type", "call_id", "output"],
        ),
        "reasoning": ({"type": {"const": "reasoning"}}, ["type"]),
    }  # fmt: skip
    return {
        "anyOf": [
            _strict_object({**properties, **{k: _ANY for k in ITEM_KEYS[kind] if k not in properties}}, required)
            for kind, (properties, required) in shapes.items()
        ]
    }


def _function_tool() -> dict:
    return _strict_object(
        {
            "type": {"const": "function", "description": "built-in tools (web_search, file_search, ...) are refused"},
            "name": {"type": "string", "pattern": _NAME.pattern},
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"], "description": "a JSON schema of the arguments"},
            "strict": _FLAG,
        },
        ["type", "name"],
    )


def _text_format() -> dict:
    json_schema = _strict_object(
        {
            "type": {"const": "json_schema"},
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "schema": {"type": "object"},
            "description": {"type": ["string", "null"]},
            "strict": _FLAG,
        },
        ["type", "name"],
    )
    plain = [_strict_object({"type": {"const": kind}}, ["type"]) for kind in FORMAT_KEYS if kind != "json_schema"]
    return {"anyOf": [{"type": "null"}, *plain, json_schema]}


# ---- what comes back ----


def response_schemas() -> dict[str, dict]:
    """The response object (`Response`) and a stream's events (`ResponseStreamEvent`)."""
    integer = {"type": "integer", "minimum": 0}
    text = {"type": "string"}
    status = {"enum": ["in_progress", "completed", "incomplete"]}
    output_text = _required(type={"const": "output_text"}, text=text, annotations={"type": "array"})
    reasoning_text = _required(type={"const": "reasoning_text"}, text=text)
    message = _required(type={"const": "message"}, id=text, role={"const": "assistant"}, status=status,
                        content={"type": "array", "items": output_text})  # fmt: skip
    call = _required(type={"const": "function_call"}, id=text, call_id=text, name=text, arguments=text, status=status)
    reasoning = _required(type={"const": "reasoning"}, id=text, summary={"type": "array"}, status=status,
                          content={"type": "array", "items": reasoning_text})  # fmt: skip
    item = {"anyOf": [message, call, reasoning]}
    usage = _required(
        input_tokens=integer,
        input_tokens_details=_required(cached_tokens=integer, cache_write_tokens=integer),
        output_tokens=integer,
        output_tokens_details=_required(reasoning_tokens=integer),
        total_tokens=integer,
    )
    response = _required(
        id=text,
        object={"const": "response"},
        created_at=integer,
        status={"enum": ["in_progress", "completed", "incomplete", "failed"]},
        error={"anyOf": [{"type": "null"}, _required(code=text, message=text)]},
        incomplete_details={"anyOf": [{"type": "null"}, _required(reason={"const": "max_output_tokens"})]},
        model=text,
        output={"type": "array", "items": item},
        usage={"anyOf": [{"type": "null"}, usage]},
        metadata={"type": "object", "additionalProperties": text},
        store={"const": False},
    )
    ref = {"$ref": "#/components/schemas/Response"}
    at: dict[str, dict] = {"item_id": text, "output_index": integer}
    part = {"anyOf": [output_text, reasoning_text]}
    events: dict[str, dict[str, dict]] = {
        "response.created": {"response": ref},
        "response.in_progress": {"response": ref},
        "response.completed": {"response": ref},
        "response.failed": {"response": ref},
        "response.output_item.added": {"output_index": integer, "item": item},
        "response.output_item.done": {"output_index": integer, "item": item},
        "response.content_part.added": {**at, "content_index": integer, "part": part},
        "response.content_part.done": {**at, "content_index": integer, "part": part},
        "response.output_text.delta": {**at, "content_index": integer, "delta": text},
        "response.output_text.done": {**at, "content_index": integer, "text": text},
        "response.reasoning_text.delta": {**at, "content_index": integer, "delta": text},
        "response.reasoning_text.done": {**at, "content_index": integer, "text": text},
        "response.function_call_arguments.delta": {**at, "delta": text},
        "response.function_call_arguments.done": {**at, "name": text, "arguments": text},
        "error": {"code": text, "message": text, "param": {"type": ["string", "null"]}},
    }
    stream_event = {
        "anyOf": [_required(type={"const": kind}, sequence_number=integer, **fields) for kind, fields in events.items()]
    }
    return {"Response": response, "ResponseStreamEvent": stream_event}


def _required(**properties) -> dict:
    return {"type": "object", "required": sorted(properties), "properties": properties}
