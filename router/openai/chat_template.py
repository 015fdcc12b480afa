"""Chat messages → prompt text, with the checkpoint's own chat template (Hugging Face's Jinja format).

A message is `{"role": str, "content": str | [{"type": "text", "text": str}, ...] | null}`; text parts
are joined with newlines (as vLLM does); any other part (images, audio) is refused, naming it. A role
is one of OpenAI's (`ROLES`, which the OpenAPI document lists as an enum); any other is a 400 naming
`messages[i].role`. Which roles may follow which is the template's business: a template that rejects a
conversation (raising in Jinja) gets a 400 naming `messages` with the template's own message. A
checkpoint without a template cannot chat (unless the router has `--chat-template` or the request its
own `chat_template`).

What else reaches the template, as transformers' `apply_chat_template` takes it: a message's `name`, an
assistant's `tool_calls` (each call's `arguments` JSON text decoded to the object templates index into,
as vLLM does), a tool message's `tool_call_id`; the request's `tools`, `chat_template_kwargs` (e.g.
Qwen3's `enable_thinking`; a key that would replace one of the arguments below is refused, naming it),
`add_generation_prompt` and `continue_final_message` (the last, assistant, message left open for the
model to go on with).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import NoReturn

from engine.errors import InvalidRequestError

MAX_MESSAGES = 4096
# OpenAI's chat roles ("function" is the legacy form of "tool"); messages carry role and content only.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# apply_chat_template's own arguments: chat_template_kwargs may not replace them.
RESERVED_KWARGS = (
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
    "return_assistant_tokens_mask",
)


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat request asks its conversation to be rendered (fields as the request names them)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: tuple[dict, ...] | None = None
    chat_template: str | None = None  # the request's own, else the router's --chat-template, else the model's
    kwargs: dict = field(default_factory=dict)  # chat_template_kwargs


def render_chat(messages, tokenizer, add_generation_prompt: bool = True, options: TemplateOptions | None = None) -> str:
    options = options or TemplateOptions(add_generation_prompt)
    template = options.chat_template
    if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
        _fail("messages", "the served model has no chat template; use /v1/completions with a prompt")
    conversation = [_message(m, i) for i, m in enumerate(_messages(messages))]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=list(options.tools) if options.tools else None,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **options.kwargs,
        )
    except Exception as err:  # noqa: BLE001 - the template's own checks (e.g. roles must alternate) raise from Jinja
        _fail("messages", f"the model's chat template rejected the conversation: {err}")
    if not isinstance(text, str):
        _fail("messages", "the model's chat template did not render to text")
    return text


def _messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        _fail("messages", "must be a non-empty list of messages")
    if len(messages) > MAX_MESSAGES:
        _fail("messages", f"at most {MAX_MESSAGES} messages")
    return messages


def _message(message, index: int) -> dict:
    field = f"messages[{index}]"
    if not isinstance(message, dict):
        _fail(field, "must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:  # a non-string too: JSON has no value equal to a role but the string itself
        _fail(f"{field}.role", f"must be one of {', '.join(ROLES)}")
    out = {"role": role, "content": _content(message.get("content"), f"{field}.content")}
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                _fail(f"{field}.{key}", "must be a string")
            out[key] = value
    if message.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{field}.tool_calls")
    return out


def template_kwargs(kwargs) -> dict:
    """`chat_template_kwargs`, checked: an object whose keys do not replace apply_chat_template's own."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        _fail("chat_template_kwargs", "must be an object")
    clash = next((key for key in kwargs if key in RESERVED_KWARGS), None)
    if clash is not None:
        _fail(f"chat_template_kwargs.{clash}", "is set by the request's own fields")
    return kwargs


def _tool_calls(calls, field: str) -> list[dict]:
    if not isinstance(calls, list):
        _fail(field, "must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            _fail(f"{field}[{i}]", 'must be {"id": ..., "type": "function", "function": {"name": ..., ...}}')
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            # Templates index into the arguments (tool_call.arguments.items()), as vLLM hands them over.
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        if not (arguments is None or isinstance(arguments, (str, dict))):
            _fail(f"{field}[{i}].function.arguments", "must be a JSON object's text")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            _fail(f"{field}[{i}].id", "must be a string")
        if call.get("type") not in (None, "function"):
            _fail(f"{field}[{i}].type", 'must be "function"')
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        out.append({**({"id": call_id} if call_id is not None else {}), **entry})
    return out


def _content(content, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _fail(field, "must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            _fail(f"{field}[{i}]", 'only text parts ({"type": "text", "text": ...}) are supported')
        texts.append(part["text"])
    return "\n".join(texts)


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(field, message)
