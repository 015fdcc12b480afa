"""vLLM's `/tokenize` and `/detokenize`: the served model's tokenizer over HTTP, with the same bodies.

    POST /tokenize   {"prompt": "text", "add_special_tokens": true} → {"count", "max_model_len", "tokens"}
    POST /tokenize   {"messages": [...], "add_generation_prompt": true, "tools": ...} (rendered as chat is)
    POST /detokenize {"tokens": [1, 2, 3]}                              → {"prompt": "text"}

`return_token_strs: true` adds each token's text (`token_strs`). A bad field is a 400 naming it, as on
the generation routes; `model`, when given, must name the served model (else a 404).
"""

from __future__ import annotations

from typing import NoReturn

from engine.errors import InvalidRequestError
from router.openai.chat_template import TemplateOptions, render_chat, template_kwargs
from router.openai.parse import Context, _model
from router.openai.tools import parse_tools

MAX_TOKENIZE_CHARS = 64 * 1024 * 1024  # the body limit bounds it anyway; a text is refused past this


def tokenize(body, context: Context) -> dict:
    body = _object(body)
    _model(body, context)
    tokenizer = _tokenizer(context, "prompt" if "messages" not in body else "messages")
    if body.get("messages") is not None:
        tools = parse_tools(body)
        options = TemplateOptions(
            add_generation_prompt=_flag(body, "add_generation_prompt", True),
            continue_final_message=_flag(body, "continue_final_message", False),
            tools=tools.tools if tools is not None else None,
            chat_template=_template(body, context) or context.chat_template,
            kwargs=template_kwargs(body.get("chat_template_kwargs")),
        )
        text = render_chat(body["messages"], tokenizer, options=options)
        special = _flag(body, "add_special_tokens", False)  # the template wrote them
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or len(text) > MAX_TOKENIZE_CHARS:
            _fail("prompt", "must be a string (or send messages)")
        special = _flag(body, "add_special_tokens", True)
    tokens = tokenizer.encode(text, add_special_tokens=special)
    out = {"count": len(tokens), "max_model_len": context.limits.max_model_len, "tokens": tokens}
    if _flag(body, "return_token_strs", False):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
    return out


def detokenize(body, context: Context) -> dict:
    body = _object(body)
    _model(body, context)
    tokenizer = _tokenizer(context, "tokens")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        _fail("tokens", "must be a list of token ids")
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < context.limits.vocab_size), None)
    if bad is not None:
        _fail(f"tokens[{bad}]", f"is outside the vocabulary [0, {context.limits.vocab_size})")
    return {"prompt": tokenizer.decode(tokens)}


def _tokenizer(context: Context, field: str):
    if context.tokenizer is None:
        _fail(field, "the served model has no tokenizer")
    return context.tokenizer


def _template(body: dict, context: Context) -> str | None:
    template = body.get("chat_template")
    if template is not None and not (isinstance(template, str) and template):
        _fail("chat_template", "must be a non-empty Jinja template string")
    if template is not None and not context.trust_request_chat_template:
        _fail("chat_template", "is refused: the server runs a request's template only with trust_request_chat_template")
    return template


def _object(body) -> dict:
    if not isinstance(body, dict):
        _fail("body", "must be a JSON object")
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        _fail(name, "must be true or false")
    return value


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(field, message)
