"""The HTTP front's response objects as JSON Schema: the components of its OpenAPI document.

They describe what `router.openai.render` writes (whole responses and stream chunks), the error object of
`router.openai.errors` (its `type` and `code` from the same table) and the bodies of `/v1/models` and
`/health`; `router.openai.openapi` assembles the document around them.
"""

from __future__ import annotations

from router.openai.errors import ALL_ERRORS


def response_schemas() -> dict[str, dict]:
    """The component schemas: whole responses, stream chunks, the error object, the model list, health."""
    integer = {"type": "integer", "minimum": 0}
    ids = {"type": "array", "items": integer}
    finish = {"enum": ["stop", "length", "tool_calls"]}  # tool_calls: the model ended by calling tools
    usage = _object(
        prompt_tokens=integer,
        completion_tokens=integer,
        total_tokens=integer,
        prompt_tokens_details=_object(cached_tokens=integer),
    )
    completion_logprobs = _object(
        tokens={"type": "array", "items": {"type": "string"}},
        token_logprobs={"type": "array", "items": {"type": ["number", "null"]}},
        top_logprobs={
            "type": "array",
            "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        },
        text_offset=ids,
    )
    top_entry = _object(token={"type": "string"}, logprob={"type": "number"}, bytes=ids)
    chat_entry = _object(**top_entry["properties"], top_logprobs={"type": "array", "items": top_entry})
    chat_logprobs = _object(content={"type": "array", "items": chat_entry})
    head: dict[str, dict] = {"id": {"type": "string"}, "created": integer, "model": {"type": "string"}}

    def response(kind: str, **fields) -> dict:
        # With return_token_ids, each choice has its token ids and its prompt's.
        choice = _object(index=integer, **fields, optional={"token_ids": ids, "prompt_token_ids": ids})
        return _object(**head, object={"const": kind}, choices={"type": "array", "items": choice}, usage=usage)

    def chunk(kind: str, **fields) -> dict:
        finish_or_null = {"enum": [*finish["enum"], None]}
        choice = _object(index=integer, **fields, finish_reason=finish_or_null, optional={"token_ids": ids})
        return _object(
            **head,
            object={"const": kind},
            choices={"type": "array", "items": choice},
            optional={"usage": {"anyOf": [{"type": "null"}, usage]}},
        )

    # Tool calls (router.openai.tools): whole in a message; in a stream, by index, the first fragment of a
    # call carrying its id, type and name, later ones more of its arguments.
    function = _object(name={"type": "string"}, arguments={"type": "string"})
    tool_call = _object(id={"type": "string"}, type={"const": "function"}, function=function)
    call_fragment = _object(
        index=integer,
        optional={
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}},
        },
    )
    text_or_null = {"type": ["string", "null"]}
    message = _object(
        role={"const": "assistant"},
        content=text_or_null,  # null when the message is only tool calls
        optional={"tool_calls": {"type": "array", "items": tool_call}, "reasoning_content": text_or_null},
    )
    delta = {
        "type": "object",
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": "string"},
            "reasoning_content": {"type": "string"},
            "tool_calls": {"type": "array", "items": call_fragment},
        },
    }
    error = _object(
        message={"type": "string"},
        type={"enum": sorted({t for _, t, _ in ALL_ERRORS})},
        param={"type": ["string", "null"]},
        code={"enum": sorted({c for _, _, c in ALL_ERRORS})},
    )
    card = _object(
        id={"type": "string"},
        object={"const": "model"},
        created=integer,
        owned_by={"type": "string"},
        root={"type": "string"},
        max_model_len=integer,
        splitserve=_object(
            model_identity={"type": "string"},
            vocab_size=integer,
            block_size=integer,
            eos_token_ids=ids,
            has_tokenizer={"type": "boolean"},
        ),
    )
    return {
        "CompletionResponse": response(
            "text_completion",
            text={"type": "string"},
            logprobs={"anyOf": [{"type": "null"}, completion_logprobs]},
            finish_reason=finish,
        ),
        "ChatCompletionResponse": response(
            "chat.completion",
            message=message,
            logprobs={"anyOf": [{"type": "null"}, chat_logprobs]},
            finish_reason=finish,
        ),
        "CompletionChunk": chunk(
            "text_completion",
            text={"type": "string"},
            logprobs={"anyOf": [{"type": "null"}, completion_logprobs]},
        ),
        "ChatCompletionChunk": chunk(
            "chat.completion.chunk",
            delta=delta,
            logprobs={"anyOf": [{"type": "null"}, chat_logprobs]},
        ),
        "Error": _object(error=error),
        "ModelList": _object(object={"const": "list"}, data={"type": "array", "items": card}),
        "Health": _object(status={"enum": ["ok", "shutting down"]}),
        "TokenizeResponse": _object(
            count=integer,
            max_model_len=integer,
            tokens=ids,
            optional={"token_strs": {"type": "array", "items": {"type": ["string", "null"]}}},
        ),
        "DetokenizeResponse": _object(prompt={"type": "string"}),
        "Version": _object(version={"type": "string"}),
    }


def _object(optional: dict | None = None, **required) -> dict:
    """An object with these properties required (and `optional` ones allowed)."""
    return {
        "type": "object",
        "required": sorted(required),
        "properties": {**required, **(optional or {})},
    }
