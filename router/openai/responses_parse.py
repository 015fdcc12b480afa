"""OpenAI's Responses request body (`POST /v1/responses`) → the chat request it asks for, and what the
response object repeats of it.

The body is translated into a chat body and parsed by `router.openai.parse.parse_chat`, so tokenization
(the chat template), sampling, structured outputs, tools and the reasoning split are chat's own:

- `input`: a string (one user message) or a list of items: messages (`role` user, system, developer or
  assistant; `content` a string or `input_text` / `output_text` parts), `function_call` items (an
  assistant message's tool calls; consecutive ones, and one right after an assistant message, join that
  message) and `function_call_output` items (tool messages). `reasoning` items an earlier response gave
  are accepted and left out of the prompt, as chat templates leave out earlier turns' thinking.
  `instructions` is a system message before them.
- `tools` in the Responses' flat shape (`{"type": "function", "name", "description", "parameters"}`) and
  `tool_choice` (`none`, `auto`, `required`, `{"type": "function", "name": N}`) become chat's; built-in
  tools (`web_search`, `file_search`, ...) are refused naming the tool's type.
- `text.format` (`text`, `json_object`, `json_schema`) becomes `response_format`; `max_output_tokens`
  becomes `max_completion_tokens`; `reasoning.effort` reaches the template as the `reasoning_effort`
  kwarg (as vLLM passes it).

The router is stateless: it stores no response, so `store: true`, `previous_response_id`, `conversation`,
`background: true` and `item_reference` items are refused naming the field. Unlike chat, an unknown field
is a 400 naming it. Errors name the field as the Responses body calls it (`max_output_tokens`,
`text.format.schema`, `tools[0].name`, `input[2].content[0].type`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from engine.errors import InvalidRequestError
from router.openai.chat_template import MAX_MESSAGES
from router.openai.parse import ApiRequest, Context, ModelNotFound, parse_chat

# Copied into the chat body as they are: chat checks them and its errors name them the same way.
PASSED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "parallel_tool_calls",
    "stream",
    "user",
    "priority",
    "tenant",
    "ttft_ms",
    "tpot_ms",
    "timeout_ms",
    "chat_template",
)
_STATELESS = "the router is stateless and keeps no responses"
# Known fields asking for what this server does not do → (the values that ask for nothing, why not).
REFUSED_FIELDS: dict[str, tuple[tuple, str]] = {
    "store": ((False,), f"{_STATELESS}; send store: false"),
    "previous_response_id": ((), f"{_STATELESS}; send the earlier output items in input"),
    "conversation": ((), f"{_STATELESS}; send the conversation's items in input"),
    "background": ((False,), f"background responses need stored state; {_STATELESS}"),
    "prompt": ((), "stored prompt templates are not served"),
    "include": (([],), "no extra output data is served"),
    "truncation": (("disabled",), "a conversation longer than the context is refused, not truncated"),
    "top_logprobs": ((0,), "logprobs are not served on /v1/responses (use /v1/chat/completions)"),
    "max_tool_calls": ((), "the number of tool calls is not capped"),
    "service_tier": (("auto", "default"), "there is one service tier"),
}
IGNORED_STRINGS = ("safety_identifier", "prompt_cache_key")  # accepted, checked as strings, read by nothing
ROLES = ("user", "system", "developer", "assistant")
TOOL_CHOICES = ("none", "auto", "required")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# What the client may send in each input item (besides `type`), by the item's type.
ITEM_KEYS = {
    "message": ("role", "content", "id", "status"),
    "function_call": ("call_id", "name", "arguments", "id", "status"),
    "function_call_output": ("call_id", "output", "id", "status"),
    "reasoning": ("id", "summary", "content", "encrypted_content", "status"),
}
TEXT_PART_TYPES = ("input_text", "output_text")  # output_text: an earlier response's message sent back
_TEXT_PART_KEYS = ("type", "text", "annotations", "logprobs")
FORMAT_KEYS = {"text": (), "json_object": (), "json_schema": ("name", "schema", "description", "strict")}
FUNCTION_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")


@dataclass(frozen=True)
class ResponseEcho:
    """What the response object repeats of the request (OpenAI's response carries its settings)."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: tuple[dict, ...] = ()
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    reasoning: dict | None = None
    user: str | None = None

    def to_json(self) -> dict:
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata,
            "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tool_choice": self.tool_choice,
            "tools": list(self.tools),
            "text": {"format": self.text_format},
            "reasoning": self.reasoning,
            "user": self.user,
        }


@dataclass(frozen=True)
class ResponsesApiRequest(ApiRequest):
    echo: ResponseEcho = field(default_factory=ResponseEcho)


def parse_responses(body, context: Context, request_id: str | None = None) -> ResponsesApiRequest:
    if not isinstance(body, dict):
        _fail("body", "must be a JSON object")
    model = body.get("model")
    if isinstance(model, str) and model not in context.model_names:  # a 404 whatever else is wrong, as chat's
        raise ModelNotFound(model, context.model_names[0])
    unknown = next((key for key in body if key not in FIELD_HANDLERS), None)
    if unknown is not None:
        _fail(unknown, "is not a field of the Responses API that this server knows")
    chat: dict = {}
    for key, value in body.items():
        if value is not None:
            FIELD_HANDLERS[key](value, key, chat)
    chat["messages"] = _messages(body.get("instructions"), body.get("input"))
    try:
        api = parse_chat(chat, context, request_id)
    except InvalidRequestError as err:
        raise InvalidRequestError(responses_field(err.field), err.reason) from None
    echo = _echo(body)
    values = {f.name: getattr(api, f.name) for f in fields(api)}
    return ResponsesApiRequest(**{**values, "kind": "response"}, echo=echo)


def responses_field(chat_field: str) -> str:
    """A field named as chat calls it → as the Responses body does."""
    for pattern, replacement in _FIELD_NAMES:
        renamed, count = pattern.subn(replacement, chat_field)
        if count:
            return renamed
    return chat_field


_FIELD_NAMES = [
    (re.compile(r"^messages\b.*$"), "input"),
    (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.(.*)$"), r"text.format.\1"),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
]


# ---- top-level fields → the chat body ----


def _passed(value, key: str, chat: dict) -> None:
    chat[key] = value


def _refused(value, key: str, chat: dict) -> None:
    neutral, why = REFUSED_FIELDS[key]
    # Compared with their types: JSON's false is not 0 here, as it is in Python.
    if not any(type(value) is type(n) and value == n for n in neutral):
        _fail(key, f"is not supported: {why}")


def _string(value, key: str, chat: dict) -> None:
    if not isinstance(value, str):
        _fail(key, "must be a string")


def _read_last(value, key: str, chat: dict) -> None:
    """instructions and input: the messages, made once every other field is known good."""


def _stream_options(value, key: str, chat: dict) -> None:
    _object(value, key, ("include_obfuscation",))
    if value.get("include_obfuscation") is not None and not isinstance(value["include_obfuscation"], bool):
        _fail("stream_options.include_obfuscation", "must be true or false")


def _max_output_tokens(value, key: str, chat: dict) -> None:
    chat["max_completion_tokens"] = value


def _metadata(value, key: str, chat: dict) -> None:
    _object(value, key)
    if len(value) > MAX_METADATA_PAIRS:
        _fail(key, f"at most {MAX_METADATA_PAIRS} key-value pairs")
    for name, text in value.items():
        if len(name) > MAX_METADATA_KEY_CHARS:
            _fail(key, f"keys are at most {MAX_METADATA_KEY_CHARS} characters")
        if not isinstance(text, str) or len(text) > MAX_METADATA_VALUE_CHARS:
            _fail(f"{key}.{name}", f"must be a string of at most {MAX_METADATA_VALUE_CHARS} characters")


def _tools(value, key: str, chat: dict) -> None:
    if not isinstance(value, list):
        _fail(key, "must be a list of function tools")
    chat["tools"] = [_tool(tool, f"{key}[{i}]") for i, tool in enumerate(value)]


def _tool(tool, name: str) -> dict:
    if not isinstance(tool, dict):
        _fail(name, 'must be {"type": "function", "name": ..., "parameters": ...}')
    kind = tool.get("type")
    if kind != "function":
        if isinstance(kind, str):
            _fail(f"{name}.type", f"{kind!r} is not served: this server runs function tools only (no built-in tools)")
        _fail(f"{name}.type", 'must be "function"')
    _object(tool, name, FUNCTION_TOOL_KEYS)
    if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
        _fail(f"{name}.strict", "must be true or false")
    # `strict` needs no translation: the arguments of a forced call are always held to the schema.
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(value, key: str, chat: dict) -> None:
    if value in TOOL_CHOICES:
        chat[key] = value
        return
    if not isinstance(value, dict):
        _fail(key, f'must be one of {", ".join(TOOL_CHOICES)} or {{"type": "function", "name": ...}}')
    if value.get("type") != "function":
        _fail(f"{key}.type", 'must be "function" (this server runs function tools only)')
    _object(value, key, ("type", "name"))
    chat[key] = {"type": "function", "function": {"name": value.get("name")}}


def _text(value, key: str, chat: dict) -> None:
    _object(value, key, ("format", "verbosity"))
    if value.get("verbosity") not in (None, "medium"):
        _fail(f"{key}.verbosity", "is not supported (only medium, the default)")
    text_format = value.get("format")
    if text_format is None:
        return
    _object(text_format, "text.format")
    kind = text_format.get("type")
    if not isinstance(kind, str) or kind not in FORMAT_KEYS:
        _fail("text.format.type", f"must be one of {', '.join(FORMAT_KEYS)}")
    _object(text_format, "text.format", ("type", *FORMAT_KEYS[kind]))
    response_format: dict = {"type": kind}
    if kind == "json_schema":
        response_format["json_schema"] = {k: v for k, v in text_format.items() if k != "type"}
    chat["response_format"] = response_format


def _reasoning(value, key: str, chat: dict) -> None:
    _object(value, key, ("effort", "summary", "generate_summary"))
    effort = value.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        _fail(f"{key}.effort", f"must be one of {', '.join(REASONING_EFFORTS)}")
    for name in ("summary", "generate_summary"):
        if value.get(name) is not None and value[name] not in REASONING_SUMMARIES:
            _fail(f"{key}.{name}", f"must be one of {', '.join(REASONING_SUMMARIES)}")
    if effort is not None:  # reasoning templates read it (as vLLM hands it over); others ignore it
        chat["chat_template_kwargs"] = {"reasoning_effort": effort, **chat.get("chat_template_kwargs", {})}


def _template_kwargs(value, key: str, chat: dict) -> None:
    _object(value, key)
    chat[key] = {**chat.get(key, {}), **value}


FIELD_HANDLERS: dict[str, Callable[[Any, str, dict], None]] = {
    **dict.fromkeys(PASSED_FIELDS, _passed),
    **dict.fromkeys(REFUSED_FIELDS, _refused),
    **dict.fromkeys(IGNORED_STRINGS, _string),
    **dict.fromkeys(("input", "instructions"), _read_last),
    "stream_options": _stream_options,
    "max_output_tokens": _max_output_tokens,
    "metadata": _metadata,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "text": _text,
    "reasoning": _reasoning,
    "chat_template_kwargs": _template_kwargs,
}


# ---- input items → chat messages ----


def _messages(instructions, items) -> list[dict]:
    messages: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            _fail("instructions", "must be a string")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        _fail("input", "must be a string or a non-empty list of input items")
    if len(items) > MAX_MESSAGES:
        _fail("input", f"at most {MAX_MESSAGES} items")
    for i, item in enumerate(items):
        name = f"input[{i}]"
        if not isinstance(item, dict):
            _fail(name, "must be an input item (an object)")
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str) or kind not in ITEM_KEYS:  # a list or object is unhashable
            if kind == "item_reference":
                _fail(f"{name}.type", f"item_reference is not supported: {_STATELESS}; send the item itself")
            _fail(f"{name}.type", f"must be one of {', '.join(ITEM_KEYS)}")
        _object(item, name, ("type", *ITEM_KEYS[kind]))
        _ITEMS[kind](item, name, messages)
    return messages


def _message(item: dict, name: str, messages: list[dict]) -> None:
    role = item.get("role")
    if role not in ROLES:
        _fail(f"{name}.role", f"must be one of {', '.join(ROLES)}")
    messages.append({"role": role, "content": _content(item.get("content"), f"{name}.content")})


def _content(content, name: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _fail(name, "must be a string or a list of input_text parts")
    parts = []
    for j, part in enumerate(content):
        part_name = f"{name}[{j}]"
        if not isinstance(part, dict):
            _fail(part_name, "must be a content part (an object)")
        kind = part.get("type")
        if kind not in TEXT_PART_TYPES:
            _fail(f"{part_name}.type", f"must be one of {', '.join(TEXT_PART_TYPES)} (this server serves text only)")
        _object(part, part_name, _TEXT_PART_KEYS)
        if not isinstance(part.get("text"), str):
            _fail(f"{part_name}.text", "must be a string")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _function_call(item: dict, name: str, messages: list[dict]) -> None:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            _fail(f"{name}.{key}", "must be a string")
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":  # one assistant turn: its text and its calls
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_call_output(item: dict, name: str, messages: list[dict]) -> None:
    if not isinstance(item.get("call_id"), str):
        _fail(f"{name}.call_id", "must be a string")
    output = _content(item.get("output"), f"{name}.output")
    messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})


def _reasoning_item(item: dict, name: str, messages: list[dict]) -> None:
    """An earlier turn's reasoning: not rendered (templates drop earlier thinking)."""


_ITEMS: dict[str, Callable[[dict, str, list[dict]], None]] = {
    "message": _message,
    "function_call": _function_call,
    "function_call_output": _function_call_output,
    "reasoning": _reasoning_item,
}


# ---- the response's echo ----


def _echo(body: dict) -> ResponseEcho:
    text = body.get("text") or {}
    reasoning = body.get("reasoning")
    return ResponseEcho(
        instructions=body.get("instructions"),
        max_output_tokens=body.get("max_output_tokens"),
        metadata=body.get("metadata") or {},
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        tool_choice=body.get("tool_choice") or "auto",
        tools=tuple(body.get("tools") or ()),
        text_format=text.get("format") or {"type": "text"},
        reasoning=None
        if reasoning is None
        else {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        user=body.get("user"),
    )


def _object(value, name: str, keys: tuple[str, ...] | None = None) -> None:
    if not isinstance(value, dict):
        _fail(name, "must be a JSON object")
    if keys is not None:
        unknown = next((key for key in value if key not in keys), None)
        if unknown is not None:
            _fail(f"{name}.{unknown}", "is not a field this server knows")


def _fail(name: str, message: str) -> NoReturn:
    raise InvalidRequestError(name, message)
