"""The HTTP front's OpenAPI 3.1 document (`GET /openapi.json`), built from what the parser checks against.

The bounds come from the parser's own tables and limits: the served model's vocabulary and context
length (`Context.limits`), the sampling keys it reads (`parse._SAMPLING_KEYS`, each needs a schema here),
the fields it refuses (`parse.UNSUPPORTED_FIELDS`), the shared rules' constants (`router.validation`,
`engine.sampling_params`, `chat_template.MAX_MESSAGES`) and the error table (`errors.ALL_ERRORS`).
A body the document rejects is one the parser rejects (a 400 naming the field, or a 404 for another
model). A body it accepts is served, except where a rule spans what JSON Schema cannot state; those
rules are listed per operation under `x-splitserve-server-rules` (field → rule), and a 400 for them
names that field. The response objects are `router.openai.openapi_responses`.
tests/router/test_openapi.py holds the parser to both directions without a cluster;
tests/router/test_http_fuzz.py does it over HTTP with schemathesis.
"""

from __future__ import annotations

from importlib import metadata

from engine.sampling_params import MAX_ABS_LOGIT_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_SEED
from router.openai.chat_template import MAX_MESSAGES, RESERVED_KWARGS, ROLES
from router.openai.errors import ALL_ERRORS
from router.openai.openapi_responses import response_schemas
from router.openai.parse import (
    _SAMPLING_KEYS,
    COMPLETION_UNSUPPORTED_FIELDS,
    MAX_CHOICES,
    MAX_JSON_DEPTH,
    UNSUPPORTED_FIELDS,
    Context,
)
from router.openai.responses_schema import request_body as responses_body
from router.openai.responses_schema import response_schemas as responses_api_schemas
from router.openai.responses_schema import server_rules as responses_rules
from router.openai.structured_fields import SERVER_RULES as STRUCTURED_OUTPUT_RULES
from router.openai.structured_fields import openapi_schemas as structured_output_schemas
from router.openai.tools import _NAME, MAX_TOOLS, TOOL_CHOICES
from router.validation import (
    _REQUEST_ID,
    MAX_PRIORITY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TENANT_CHARS,
)
from splitserve_client.sdk_types import SENT_AT_KEY

OPENAPI_VERSION = "3.1.0"
SERVER_RULES_KEY = "x-splitserve-server-rules"
TEXT_CHARS_PER_TOKEN = 64  # router.validation.text_prompt refuses a text longer than this many chars per token


def openapi_document(context: Context, *, auth: bool, max_body_bytes: int) -> dict:
    """The document for a server with these limits; `auth`: the `/v1/` routes and this document need
    the bearer token."""
    fields = _Fields(context)
    completion_rules = {
        "prompt": f"a text prompt tokenizes to 1..{context.limits.max_model_len - 1} tokens",
        "n": f"prompts x n is at most {MAX_CHOICES}",
        "best_of": "equals n",
        "min_tokens": "at most max_tokens",
        "logit_bias": "names each token once (05 and 5 are one token)",
        **STRUCTURED_OUTPUT_RULES,
    }
    chat_rules = {
        "messages": "the chat template renders the conversation (it may require roles to alternate), "
        f"to 1..{context.limits.max_model_len - 1} tokens",
        "best_of": "equals n",
        "min_tokens": "at most max_tokens (by default the tokens left in the context)",
        "logit_bias": completion_rules["logit_bias"],
        "tools": "names each function once; with tool_choice required or named, the parameters compile as a "
        "JSON schema",
        "tool_choice": "a named function is one of tools; required or a name needs tools; auto (the default with "
        "tools) needs the server's --tool-call-parser",
        "chat_template": "accepted only by a server with trust_request_chat_template; renders the conversation",
        "chat_template_kwargs": "the template renders with them",
        "continue_final_message": "not with add_generation_prompt true (its default)",
        **STRUCTURED_OUTPUT_RULES,
    }
    secured: list | None = [{"bearer": []}] if auth else None
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "splitserve OpenAI-compatible HTTP API",
            "version": _version(),
            "description": f"Serves {context.model_names[0]!r}: a context of {context.limits.max_model_len} tokens, "
            f"a vocabulary of {context.limits.vocab_size}. Unknown body fields are ignored; a known field with a "
            f"bad value is a 400 naming it in error.param. Bodies up to {max_body_bytes} bytes (a larger one is a "
            f"413), with arrays and objects nested up to {MAX_JSON_DEPTH} levels (a deeper one is a 400 naming body).",
        },
        "paths": {
            "/v1/completions": {
                "post": _generate(
                    "createCompletion",
                    "Text completion",
                    fields.completion(),
                    "CompletionResponse",
                    "CompletionChunk",
                    completion_rules,
                    secured,
                )
            },
            "/v1/chat/completions": {
                "post": _generate(
                    "createChatCompletion",
                    "Chat completion with the checkpoint's chat template",
                    fields.chat(),
                    "ChatCompletionResponse",
                    "ChatCompletionChunk",
                    chat_rules,
                    secured,
                )
            },
            "/v1/responses": {
                "post": _generate(
                    "createResponse",
                    "OpenAI's Responses API, stateless, over the chat path",
                    responses_body({**fields._shared(), **_chat_fields()}, fields.max_tokens, {"type": "string"}),
                    "Response",
                    "ResponseStreamEvent",
                    responses_rules(chat_rules),
                    secured,
                    "the whole response, or with stream: server-sent events (event: TYPE, data: JSON) ending with "
                    "response.completed (or, after a failure, error and response.failed)",
                )
            },
            "/v1/models": {"get": _get("listModels", "The served model", _json_ref("ModelList"), secured)},
            "/tokenize": {
                "post": _tokenizer_route(
                    "tokenize",
                    "The served tokenizer over a text, or a conversation as chat renders it",
                    fields.tokenize(),
                    "TokenizeResponse",
                    secured,
                    {
                        name: chat_rules[name]
                        for name in (
                            "messages",
                            "tools",
                            "chat_template",
                            "chat_template_kwargs",
                            "continue_final_message",
                        )
                    },
                )
            },
            "/detokenize": {
                "post": _tokenizer_route(
                    "detokenize", "Token ids back to text", fields.detokenize(), "DetokenizeResponse", secured, {}
                )
            },
            "/version": {"get": _get("version", "The server's version", _json_ref("Version"), None)},
            "/health": {
                "get": {
                    **_get("health", "Liveness for probes", _json_ref("Health"), None),
                    "responses": {
                        "200": {"description": "serving", "content": _json_ref("Health")},
                        "503": {"description": "shutting down", "content": _json_ref("Health")},
                    },
                }
            },
            "/metrics": {
                "get": _get(
                    "metrics", "The router's Prometheus registry", {"text/plain": {"schema": {"type": "string"}}}, None
                )
            },
            "/openapi.json": {
                "get": _get("openapi", "This document", {"application/json": {"schema": {"type": "object"}}}, secured)
            },
        },
        "components": {
            "schemas": {**response_schemas(), **responses_api_schemas()},
            **({"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}} if auth else {}),
        },
    }


def _version() -> str:
    try:
        return metadata.version("splitserve")
    except metadata.PackageNotFoundError:
        return "unknown"


def _json_ref(name: str) -> dict:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def _get(operation_id: str, summary: str, content: dict, security: list | None) -> dict:
    responses: dict = {"200": {"description": summary, "content": content}}
    if security:
        responses["401"] = _error_response(401)
    return {
        "operationId": operation_id,
        "summary": summary,
        "security": security or [],
        "responses": responses,
    }


def _error_response(status: int) -> dict:
    response: dict = {"description": _STATUS_WHEN[status], "content": _json_ref("Error")}
    if status == 429:
        whole_s = {"schema": {"type": "string", "pattern": "^[0-9]+$"}}
        response["headers"] = {
            "Retry-After": {**whole_s, "description": "whole seconds, rounded up"},
            "retry-after-ms": {**whole_s, "description": "the exact figure in milliseconds"},
        }
    return response


_STATUS_WHEN = {
    400: "a bad or unsupported field, named in error.param (body: not JSON, or nested too deep)",
    401: "missing or wrong bearer token",
    404: "model names another model",
    409: "that X-Request-Id is still running",
    413: "the body is over the size limit (error.param: body)",
    429: "admission, the concurrency limit or a full decode pool refused it",
    500: "a bug (details in the router's log)",
    503: "a worker lost, or no serving worker",
    504: "timeout_ms passed",
}


def _generate(
    operation_id: str,
    summary: str,
    body: dict,
    whole: str,
    chunk: str,
    rules: dict[str, str],
    security: list | None,
    stream_description: str = "the whole response, or with stream: server-sent events ending `data: [DONE]`",
) -> dict:
    statuses = sorted({status for status, _, _ in ALL_ERRORS})
    event_data = {
        # A chunk, an error after the 200, or the stream's end.
        "if": {"properties": {"data": {"const": "[DONE]"}}},
        "else": {
            "properties": {
                "data": {
                    "contentMediaType": "application/json",
                    "contentSchema": {
                        "anyOf": [{"$ref": f"#/components/schemas/{chunk}"}, {"$ref": "#/components/schemas/Error"}]
                    },
                }
            }
        },
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string"}},
    }
    return {
        "operationId": operation_id,
        "summary": summary,
        "security": security or [],
        SERVER_RULES_KEY: rules,
        "parameters": [
            {
                "name": "X-Request-Id",
                "in": "header",
                "description": "the request id (choice i runs as ID-i); empty or left out: the router makes one",
                "schema": {"type": "string", "pattern": "^(" + _REQUEST_ID.pattern + ")?$"},
            },
            {
                "name": SENT_AT_KEY,
                "in": "header",
                "description": "send time, whole microseconds since the Unix epoch (admission counts TTFT from it)",
                "schema": {"type": "string", "pattern": "^[0-9]{1,20}$"},
            },
        ],
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            "200": {
                "description": stream_description,
                "content": {**_json_ref(whole), "text/event-stream": {"schema": event_data}},
            },
            **{
                str(status): _error_response(status)
                for status in statuses
                if status != 401 or security  # a 401 only where a token is asked for
            },
        },
    }


def _tokenizer_route(
    operation_id: str, summary: str, body: dict, response: str, security: list | None, rules: dict[str, str]
) -> dict:
    """vLLM's /tokenize and /detokenize (router.openai.tokenize): JSON in, JSON out, errors as elsewhere."""
    operation = _get(operation_id, summary, _json_ref(response), security)
    operation[SERVER_RULES_KEY] = rules
    operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    for status in (400, 404):
        operation["responses"][str(status)] = _error_response(status)
    return operation


class _Fields:
    """The request bodies' schemas for one server's limits."""

    def __init__(self, context: Context):
        self.limits = context.limits
        self.model_names = context.model_names
        vocab, length = self.limits.vocab_size, self.limits.max_model_len
        self.token_id = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
        self.tokens = {"type": "array", "minItems": 1, "maxItems": length - 1, "items": self.token_id}
        self.text = {"type": "string", "minLength": 1, "maxLength": TEXT_CHARS_PER_TOKEN * length}
        self.max_tokens = {"type": ["integer", "null"], "minimum": 1, "maximum": length - 1}

    def _sampling(self) -> dict[str, dict]:
        limits = self.limits
        stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
        stop_strings = {
            "type": "array",
            "maxItems": MAX_STOP_STRINGS if limits.has_tokenizer else 0,
            "items": stop_string,
        }
        number = {"type": ["number", "null"]}
        flag = {"type": ["boolean", "null"]}
        schemas: dict[str, dict] = {
            "temperature": {**number, "minimum": 0, "description": "0: greedy"},
            "top_p": {**number, "exclusiveMinimum": 0, "maximum": 1},
            "seed": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": MAX_SEED,
                "description": "choice i: seed + i",
            },
            "stop": {
                "anyOf": [{"type": "null"}, stop_strings, *([stop_string] if limits.has_tokenizer else [])],
                "description": "stop strings (the text ends before them)",
            },
            "presence_penalty": {**number, "minimum": -2, "maximum": 2},
            "frequency_penalty": {**number, "minimum": -2, "maximum": 2},
            "logit_bias": {
                "type": ["object", "null"],
                "maxProperties": MAX_LOGIT_BIAS,
                "propertyNames": {"pattern": "^0*(" + decimal_below(limits.vocab_size) + ")$"},
                "additionalProperties": {
                    "type": "number",
                    "minimum": -MAX_ABS_LOGIT_BIAS,
                    "maximum": MAX_ABS_LOGIT_BIAS,
                },
                "description": "token id (a decimal string) → bias added to its logit",
            },
            "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N, "description": "choices per prompt"},
            "top_k": {"type": ["integer", "null"], "minimum": -1, "description": "-1 or 0: off"},
            "min_p": {**number, "minimum": 0, "maximum": 1},
            "repetition_penalty": {**number, "exclusiveMinimum": 0},
            "min_tokens": {"type": ["integer", "null"], "minimum": 0, "maximum": limits.max_model_len - 1},
            "ignore_eos": flag,
            "stop_token_ids": {"type": ["array", "null"], "items": self.token_id},
            "skip_special_tokens": flag,
            "include_stop_str_in_output": flag,
        }
        differ = set(_SAMPLING_KEYS) ^ set(schemas)
        if differ:  # a sampling key read from bodies is documented, or the router does not start
            raise RuntimeError(f"parse._SAMPLING_KEYS and the OpenAPI document differ in {sorted(differ)}")
        return schemas

    def _shared(self) -> dict[str, dict]:
        """Fields both endpoints read, beside the sampling ones."""
        flag = {"type": ["boolean", "null"]}
        slo_ms = {"type": ["number", "null"], "minimum": 0, "description": "0 or null: the priority class's default"}
        unsupported = {
            name: {"enum": [None, *neutral], "description": "not supported: only what asks for nothing"}
            for name, neutral in UNSUPPORTED_FIELDS.items()
        }
        return {
            "model": {"enum": [*self.model_names, None], "description": "another name is a 404"},
            **self._sampling(),
            **unsupported,
            **structured_output_schemas(),
            "best_of": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N, "description": "only n"},
            "stream": flag,
            "stream_options": {
                "type": ["object", "null"],
                "properties": {
                    "include_usage": flag,
                    "continuous_usage_stats": {**flag, "description": "with include_usage: usage on every chunk"},
                },
            },
            "return_token_ids": {**flag, "description": "token ids beside the text"},
            "priority": {
                "type": ["integer", "null"],
                "minimum": -MAX_PRIORITY,
                "maximum": MAX_PRIORITY,
                "description": "vLLM's meaning: lower is served first (the gRPC priority is its negation)",
            },
            "tenant": {"type": ["string", "null"], "maxLength": MAX_TENANT_CHARS},
            "ttft_ms": slo_ms,
            "tpot_ms": slo_ms,
            "timeout_ms": {"type": ["number", "null"], "exclusiveMinimum": 0, "description": "the request's deadline"},
            "user": {"type": ["string", "null"], "description": "ignored"},
        }

    def completion(self) -> dict:
        prompts = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"anyOf": self._prompt_forms()}}
        properties = {
            "prompt": {
                "anyOf": [*self._prompt_forms(), prompts],
                "description": "text or token ids, or a list of such",
            },
            "echo": {"type": ["boolean", "null"]},
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
            # 0 only with echo: the prompt (and its logprobs) alone.
            "max_tokens": {**self.max_tokens, "minimum": 0, "description": "default 16; 0 only with echo"},
            **{
                name: {"enum": [None, *neutral], "description": "chat only: here only what asks for nothing"}
                for name, neutral in COMPLETION_UNSUPPORTED_FIELDS.items()
            },
            **self._shared(),
        }
        return {
            "type": "object",
            "required": ["prompt"],
            "properties": properties,
            "if": {"required": ["echo"], "properties": {"echo": {"const": True}}},
            "else": {"properties": {"max_tokens": {"not": {"const": 0}}}},
        }

    def _prompt_forms(self) -> list[dict]:
        return [self.text, self.tokens] if self.limits.has_tokenizer else [self.tokens]

    def chat(self) -> dict:
        part = {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        }
        content = {"anyOf": [{"type": "null"}, {"type": "string"}, {"type": "array", "items": part}]}
        function_call = {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": ["string", "object", "null"]}},
        }
        tool_call = {
            "type": "object",
            "required": ["function"],
            "properties": {
                "id": {"type": ["string", "null"]},
                "type": {"enum": ["function", None]},
                "function": function_call,
            },
        }
        message = {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"enum": list(ROLES)},
                "content": content,
                "name": {"type": ["string", "null"]},
                "tool_call_id": {"type": ["string", "null"]},
                "tool_calls": {"type": ["array", "null"], "items": tool_call},
            },
        }
        properties = {
            "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": message},
            "add_generation_prompt": {"type": ["boolean", "null"]},
            "max_completion_tokens": {**self.max_tokens, "description": "default: the tokens left in the context"},
            "max_tokens": {**self.max_tokens, "description": "the older name of max_completion_tokens"},
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
            **self._shared(),
            **_chat_fields(),
        }
        return {
            "type": "object",
            "required": ["messages"],
            "properties": properties,
            "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        }

    def tokenize(self) -> dict:
        flag = {"type": ["boolean", "null"]}
        shared = {
            "model": self._shared()["model"],
            "add_special_tokens": {**flag, "description": "default: true for a prompt, false for messages"},
            "return_token_strs": {**flag, "description": "each token's text beside its id"},
        }
        chat = self.chat()["properties"]
        conversation = {
            name: chat[name]
            for name in ("messages", "add_generation_prompt", "continue_final_message", "tools", "chat_template")
        }
        conversation["chat_template_kwargs"] = chat["chat_template_kwargs"]
        return {
            "anyOf": [
                {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}, **shared}},
                {"type": "object", "required": ["messages"], "properties": {**conversation, **shared}},
            ]
        }

    def detokenize(self) -> dict:
        return {
            "type": "object",
            "required": ["tokens"],
            "properties": {"tokens": {"type": "array", "items": self.token_id}, "model": self._shared()["model"]},
        }


def _chat_fields() -> dict[str, dict]:
    """Tool calling and template control (router.openai.tools, router.openai.chat_template)."""
    flag = {"type": ["boolean", "null"]}
    function = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": _NAME.pattern},
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"], "description": "a JSON schema of the arguments"},
        },
    }
    tool = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": function},
    }
    named = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
        },
    }
    return {
        "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": tool},
        "tool_choice": {
            "anyOf": [{"enum": [None, *TOOL_CHOICES]}, named],
            "description": "auto (the default with tools), none, required, or a named function",
        },
        "parallel_tool_calls": {**flag, "description": "required: more than one call (default true)"},
        "chat_template": {"type": ["string", "null"], "minLength": 1, "description": "Jinja, instead of the model's"},
        "chat_template_kwargs": {
            "type": ["object", "null"],
            "propertyNames": {"not": {"enum": list(RESERVED_KWARGS)}},
            "description": "extra template variables (e.g. enable_thinking)",
        },
        "continue_final_message": {**flag, "description": "leave the last (assistant) message open"},
    }


def decimal_below(bound: int) -> str:
    """A regular expression (no anchors, no leading zeros) for the decimal integers in [0, bound)."""
    top = str(bound - 1)
    alternatives = ["[0-9]"] if len(top) > 1 else []
    alternatives += [f"[1-9][0-9]{{{width - 1}}}" for width in range(2, len(top))]
    for i, digit in enumerate(top):
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > low:
            rest = f"[0-9]{{{len(top) - i - 1}}}" if i < len(top) - 1 else ""
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}]{rest}")
    alternatives.append(top)
    return "|".join(alternatives)
