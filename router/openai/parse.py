"""OpenAI JSON body → the domain requests it asks for, with the shared rules of `router.validation`.

One body becomes one `RouterRequest` per (prompt, choice): `/v1/completions` takes a prompt as a
string, a list of strings, token ids or a list of token-id lists, each run `n` times; chat takes
`messages`, rendered with the checkpoint's chat template (`router.openai.chat_template`). Choice i of
a prompt runs with seed + i when seeded. Unknown fields are ignored, as OpenAI does; a known field
with a bad value raises `InvalidRequestError` naming it as the client sent it (`max_completion_tokens`,
`temperature`, `prompt`, `messages[2].content`). Fields the engine cannot honour (`suffix`,
`best_of` > n, legacy `functions`) are refused rather than dropped; `response_format` and
`structured_outputs` are `router.openai.structured_fields`. Chat's
`tools` and `tool_choice` are `router.openai.tools`; how the output is split into reasoning, content and
tool calls is `router.openai.tool_stream`. `priority` has vLLM's meaning here (lower is served first):
the router's own priority (higher first, as over gRPC) is its negation. `null` is a field
left out; no other value stands in for it. `router.openai.openapi` builds the OpenAPI document of these
rules from the same tables and limits.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NoReturn, cast

import numpy as np

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutputSpec
from router.openai.chat_template import TemplateOptions, render_chat, template_kwargs
from router.openai.reasoning import REASONING_PARSERS
from router.openai.structured_fields import structured_output
from router.openai.tool_stream import OutputParsing
from router.openai.tools import ToolRequest, parse_tools, tool_call_parser
from router.validation import (
    ModelLimits,
    RouterRequest,
    check_priority,
    check_request_id,
    check_slo_ms,
    check_tenant,
    sampling_params,
    text_prompt,
    token_prompt,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_CHOICES = 256  # prompts x n in one body
MAX_BODY_BYTES = 64 * 1024 * 1024  # a longer body is a 413, before it is read whole
MAX_JSON_DEPTH = 64  # arrays and objects nested deeper are a 400, before the JSON is decoded
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
# Sampling fields read from the body as they are (OpenAI's, then vLLM's extra ones).
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "n",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
# Known fields the engine cannot honour → the values that ask for nothing, accepted besides null. The
# OpenAPI document lists the same.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "suffix": ("",),
    "functions": ([],),
}
# Chat's tool fields, on /v1/completions (which has no messages to call tools from), the same way.
COMPLETION_UNSUPPORTED_FIELDS: dict[str, tuple] = {"tools": ([],), "tool_choice": ("none", "auto")}


@dataclass(frozen=True)
class Choice:
    index: int  # in the response's `choices`
    prompt_index: int
    request: RouterRequest
    echo: str | None  # completions with echo: the prompt's text, sent before the completion
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) alone, nothing generated


@dataclass(frozen=True)
class ApiRequest:
    kind: str  # "completion" or "chat"
    model: str
    request_id: str
    choices: tuple[Choice, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token to return; None: no logprobs
    return_token_ids: bool  # vLLM's extra field: token ids beside the text
    timeout_s: float | None
    output: OutputParsing | None = None  # chat: reasoning and tool-call parsing of each choice's text
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far on every chunk


@dataclass(frozen=True)
class Context:
    """What parsing needs from the router: the model's limits, its tokenizer and its served name."""

    limits: ModelLimits
    tokenizer: PreTrainedTokenizerBase | None
    model_names: tuple[str, ...]  # the first is the name responses carry
    tool_call_parser: str | None = None  # a name in tools.TOOL_CALL_PARSERS: parses tool_choice auto
    reasoning_parser: str | None = None  # a name in reasoning.REASONING_PARSERS
    chat_template: str | None = None  # the router's --chat-template (Jinja text): replaces the model's
    trust_request_chat_template: bool = False  # a request may bring its own chat_template

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            _fail("prompt", "the served model has no tokenizer; send token ids")
        return self.tokenizer.encode(text, add_special_tokens=True)


class ModelNotFound(LookupError):
    def __init__(self, model: str, served: str):
        super().__init__(f"the model {model!r} does not exist; this server serves {served!r}")


class BodyTooLarge(InvalidRequestError):
    """A body over MAX_BODY_BYTES: a 413 (router.openai.errors), naming the limit."""

    def __init__(self, limit: int = MAX_BODY_BYTES):
        super().__init__("body", f"is larger than the limit of {limit} bytes")


# A JSON string (its escapes included), and the bytes that are not brackets.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_DEPTH_CHUNK = 1 << 20  # brackets per numpy step: bounded memory for any body


def decode_body(raw: bytes):
    """A request body's JSON. A number with a zero fraction (`16.0`, `1e3`) is read as an integer, as JSON
    Schema (and OpenAI's API) read it, so that `"max_tokens": 16.0` is 16 and not a type error. Arrays and
    objects nested deeper than MAX_JSON_DEPTH are refused before decoding (the decoder recurses per level)."""
    encoding = json.detect_encoding(raw)
    try:
        text = raw.decode(encoding, "surrogatepass")
    except UnicodeDecodeError:
        raise InvalidRequestError("body", "is not valid JSON") from None
    utf8 = raw if encoding in ("utf-8", "utf-8-sig") else text.encode("utf-8", "surrogatepass")
    if json_depth_exceeds(utf8, MAX_JSON_DEPTH):
        _fail("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, parse_float=_json_float)
    except RecursionError:  # brackets that never close (malformed, so not measured above)
        _fail("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    except ValueError:
        raise InvalidRequestError("body", "is not valid JSON") from None


def json_depth_exceeds(utf8: bytes, limit: int) -> bool:
    """Whether arrays and objects in this UTF-8 JSON nest more than `limit` levels deep (brackets inside
    strings do not count). Linear and without recursion: the strings are cut out, the brackets kept, and
    the running depth summed with numpy; a body with few brackets is not scanned at all."""
    if utf8.count(b"[") + utf8.count(b"{") <= limit:
        return False
    if b'"' in utf8:
        utf8 = _JSON_STRING.sub(b"", utf8)
    brackets = np.frombuffer(utf8.translate(None, _NOT_BRACKETS), dtype=np.uint8)
    depth = 0
    for start in range(0, len(brackets), _DEPTH_CHUNK):
        # "[" and "{" have bit 1 set, "]" and "}" do not: +1 and -1.
        steps = (brackets[start : start + _DEPTH_CHUNK] & 2).astype(np.int8) - 1
        running = np.cumsum(steps, dtype=np.int64) + depth
        if running.max() > limit:
            return True
        depth = int(running[-1])
    return False


def _json_float(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() else value


def parse_completion(body, context: Context, request_id: str | None = None) -> ApiRequest:
    body = _object(body)
    model = _model(body, context)  # an unknown model is a 404 whatever else is wrong
    prompts = _completion_prompts(body.get("prompt"), context)
    echo = _flag(body, "echo")
    logprobs = _optional_int(body, "logprobs")
    max_tokens = body.get("max_tokens")
    # OpenAI's way to score a prompt without generating: echo with max_tokens 0. The engine samples one
    # token (the prompt's last logits are computed anyway) and the response leaves it out, as vLLM does.
    echo_only = echo and _is_int(max_tokens) and max_tokens == 0
    if echo_only:
        max_tokens = 1
    values = _sampling_values(body, COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, logprobs)
    _refuse_unsupported(body, COMPLETION_UNSUPPORTED_FIELDS)
    if echo and logprobs is not None:  # the echoed prompt's tokens come with their logprobs too
        values["prompt_logprobs"] = logprobs
    echoes = [_prompt_text(text, tokens, context) if echo else None for text, tokens in prompts]
    api = _api_request("completion", model, body, context, prompts, values, {}, echoes, logprobs, request_id)
    return replace(api, choices=tuple(replace(c, echo_only=True) for c in api.choices)) if echo_only else api


def parse_chat(body, context: Context, request_id: str | None = None) -> ApiRequest:
    body = _object(body)
    model = _model(body, context)
    tools = parse_tools(body)
    text = render_chat(body.get("messages"), context.tokenizer, options=_template_options(body, context, tools))
    tokenizer = context.tokenizer
    assert tokenizer is not None, "render_chat refuses a model without one"
    tokens = text_prompt(text, context.limits, lambda t: tokenizer.encode(t, add_special_tokens=False), "messages")
    names = {}
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
        if body.get("max_tokens") is not None:  # the older name, overridden, is still checked
            sampling_params({"max_tokens": body["max_tokens"]}, context.limits)
    else:
        max_tokens = body.get("max_tokens")
    if max_tokens is None:  # chat's default: up to the context length
        max_tokens = context.limits.max_model_len - len(tokens)
    want_logprobs = _flag(body, "logprobs")
    top = _optional_int(body, "top_logprobs")
    if top is not None and not want_logprobs:
        _fail("top_logprobs", "needs logprobs: true")
    logprobs = (top or 0) if want_logprobs else None
    if top is not None:
        names["logprobs"] = "top_logprobs"
    values = _sampling_values(body, max_tokens, logprobs)
    output = _output_parsing(tools, context)
    if output is not None and output.tool_parser is not None and output.tool_parser.reads_special_tokens:
        values.setdefault("skip_special_tokens", False)  # the parser's markers are special tokens
    structured = tools.structured_output() if tools is not None else None
    api = _api_request(
        "chat", model, body, context, [(text, tokens)], values, names, [None], logprobs, request_id, structured
    )
    return replace(api, output=output)


def _template_options(body: dict, context: Context, tools: ToolRequest | None) -> TemplateOptions:
    template = body.get("chat_template")
    if template is not None and not (isinstance(template, str) and template):
        _fail("chat_template", "must be a non-empty Jinja template string")
    if template is not None and not context.trust_request_chat_template:
        _fail("chat_template", "is refused: the server runs a request's template only with trust_request_chat_template")
    options = TemplateOptions(
        add_generation_prompt=_flag(body, "add_generation_prompt", default=True),
        continue_final_message=_flag(body, "continue_final_message"),
        tools=tools.tools if tools is not None else None,
        chat_template=template or context.chat_template,
        kwargs=template_kwargs(body.get("chat_template_kwargs")),
    )
    if options.add_generation_prompt and options.continue_final_message:
        _fail("continue_final_message", "cannot be true with add_generation_prompt true (send it false)")
    return options


def _output_parsing(tools: ToolRequest | None, context: Context) -> OutputParsing | None:
    """How each choice's text is split, or None: the text is the content, as it was generated."""
    if tools is not None and tools.choice == "auto" and context.tool_call_parser is None:
        _fail("tool_choice", '"auto" needs a tool-call parser: start the server with --tool-call-parser')
    reasoning = REASONING_PARSERS[context.reasoning_parser]() if context.reasoning_parser else None
    if tools is None and reasoning is None:
        return None
    auto = tools is not None and tools.choice == "auto" and context.tool_call_parser is not None
    parser = tool_call_parser(context.tool_call_parser, tools=tools) if auto and context.tool_call_parser else None
    return OutputParsing(tools, parser, reasoning)


def _api_request(
    kind: str,
    model: str,
    body: dict,
    context: Context,
    prompts,
    values: dict,
    names: dict,
    echoes,
    logprobs,
    request_id: str | None,
    structured: StructuredOutputSpec | None = None,
) -> ApiRequest:
    params = sampling_params(values, context.limits, "", names)
    if structured is not None:  # tool_choice required or named: the output is held to the tools' schemas
        params = replace(params, structured_output=structured)
    _refuse_unsupported(body, UNSUPPORTED_FIELDS)
    user = body.get("user")
    if user is not None and not isinstance(user, str):  # read by nothing, yet checked as OpenAI's string
        _fail("user", "must be a string")
    requested = structured_output(body, context.limits)  # response_format / structured_outputs
    if requested is not None:
        if structured is not None:
            _fail(requested.field, "cannot be combined with tool_choice required or a named function")
        params = replace(params, structured_output=requested)
    best_of = _optional_int(body, "best_of")
    if best_of is not None and best_of != params.n:
        _fail("best_of", "is not supported by this server (only best_of == n)")
    if len(prompts) * params.n > MAX_CHOICES:
        _fail("n", f"prompts x n is {len(prompts) * params.n}; at most {MAX_CHOICES} completions per request")
    request_id = check_request_id(request_id or uuid.uuid4().hex, "X-Request-Id")
    extras = _extras(body)
    choices = []
    for prompt_index, ((text, tokens), echo) in enumerate(zip(prompts, echoes, strict=True)):
        for choice in range(params.n):
            index = prompt_index * params.n + choice
            request = RouterRequest(
                f"{request_id}-{index}",
                tokens,
                params.for_choice(choice),
                *extras,
                return_text=context.limits.has_tokenizer,
                prompt_text=text,
            )
            choices.append(Choice(index, prompt_index, request, echo))
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    options = {} if options is None else _object(options, "stream_options")
    include_usage = _flag(options, "include_usage", field="stream_options.include_usage") and stream
    # As vLLM: per-chunk usage is an addition to include_usage, not a replacement for it.
    continuous = _flag(options, "continuous_usage_stats", field="stream_options.continuous_usage_stats")
    continuous = continuous and include_usage
    return ApiRequest(
        kind,
        model,
        request_id,
        tuple(choices),
        stream,
        include_usage,
        logprobs,
        _flag(body, "return_token_ids"),
        _timeout_s(body),
        continuous_usage=continuous,
    )


def _refuse_unsupported(body: dict, fields: dict[str, tuple]) -> None:
    for name, neutral in fields.items():
        value = body.get(name)
        # Compared with their types: JSON's false is not "" and 0 is not [] here, as they are in Python.
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            _fail(name, "is not supported by this server")


def _completion_prompts(prompt, context: Context) -> list[tuple[str | None, tuple[int, ...]]]:
    """[(text or None, tokens)] per prompt, from any of the four shapes OpenAI accepts."""
    if isinstance(prompt, str):
        return [(prompt, text_prompt(prompt, context.limits, context.tokenize, "prompt"))]
    if not isinstance(prompt, list) or not prompt:
        _fail("prompt", "must be a string, a list of strings, a list of token ids or a list of such lists")
    if _is_int(prompt[0]):  # one prompt of token ids
        bad = next((i for i, t in enumerate(prompt) if not _is_int(t)), None)
        if bad is not None:
            _fail(f"prompt[{bad}]", "token ids must be integers")
        return [(None, token_prompt(tuple(prompt), context.limits, "prompt"))]
    out: list[tuple[str | None, tuple[int, ...]]] = []
    for i, item in enumerate(prompt):
        field = f"prompt[{i}]"
        if isinstance(item, str):
            out.append((item, text_prompt(item, context.limits, context.tokenize, field)))
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            out.append((None, token_prompt(tuple(item), context.limits, field)))
        else:
            _fail(field, "must be a string or a list of integer token ids")
    return out


def _sampling_values(body: dict, max_tokens, logprobs: int | None) -> dict:
    values = {key: body[key] for key in _SAMPLING_KEYS if body.get(key) is not None}
    top_k = values.get("top_k")
    if _is_int(top_k) and top_k in (-1, 0):  # vLLM's spelling of "no top-k"
        del values["top_k"]
    # JSON shapes the shared rules would take apart (an object's keys as a list, a key in Unicode digits).
    if "stop" in values and not isinstance(values["stop"], (str, list)):
        _fail("stop", "must be a string or a list of strings")
    if "stop_token_ids" in values and not isinstance(values["stop_token_ids"], list):
        _fail("stop_token_ids", "must be a list of token ids")
    bias = values.get("logit_bias")
    if isinstance(bias, dict) and not all(key.isascii() for key in bias):
        _fail("logit_bias", "keys are token ids written in ASCII digits")
    values["max_tokens"] = max_tokens
    if logprobs is not None:
        values["logprobs"] = logprobs
    return values


def _extras(body: dict) -> tuple[int, str, float | None, float | None]:
    """splitserve's own fields, in RouterRequest order: priority, tenant, ttft_ms, tpot_ms. `priority` is
    vLLM's (lower first); the router's is its negation (higher first)."""
    priority = -check_priority(body.get("priority", 0) if body.get("priority") is not None else 0)
    tenant = check_tenant(body.get("tenant") if body.get("tenant") is not None else "")
    return priority, tenant, check_slo_ms(body.get("ttft_ms"), "ttft_ms"), check_slo_ms(body.get("tpot_ms"), "tpot_ms")


def _timeout_s(body: dict) -> float | None:
    value = body.get("timeout_ms")
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        _fail("timeout_ms", "must be a finite number of milliseconds > 0")
    return value / 1000.0


def _model(body: dict, context: Context) -> str:
    model = body.get("model")
    if model is not None and model not in context.model_names:
        if not isinstance(model, str):
            _fail("model", "must be a string")
        raise ModelNotFound(model, context.model_names[0])
    return context.model_names[0]


def _prompt_text(text: str | None, tokens: tuple[int, ...], context: Context) -> str:
    if text is not None:
        return text
    if context.tokenizer is None:
        return ""
    return cast(str, context.tokenizer.decode(list(tokens), skip_special_tokens=True))  # one sequence: one str


def _object(value, field: str = "body") -> dict:
    if not isinstance(value, dict):
        _fail(field, "must be a JSON object")
    return value


def _flag(body: dict, name: str, default: bool = False, field: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        _fail(field or name, "must be true or false")
    return value


def _optional_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and not _is_int(value):
        _fail(name, "must be an integer")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(field: str, message: str) -> NoReturn:
    raise InvalidRequestError(field, message)
