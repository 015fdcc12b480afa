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
from router.openai.chat_template import MAX_MESSAGES, ROLES
from router.openai.errors import ALL_ERRORS
from router.openai.openapi_responses import response_schemas
from router.openai.parse import _SAMPLING_KEYS, MAX_CHOICES, MAX_JSON_DEPTH, UNSUPPORTED_FIELDS, Context
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
    }
    chat_rules = {
        "messages": "the chat template renders the conversation (it may require roles to alternate), "
        f"to 1..{context.limits.max_model_len - 1} tokens",
        "best_of": "equals n",
        "min_tokens": "at most max_tokens (by default the tokens left in the context)",
        "logit_bias": completion_rules["logit_bias"],
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
            "/v1/models": {"get": _get("listModels", "The served model", _json_ref("ModelList"), secured)},
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
            "schemas": response_schemas(),
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
                "description": "the whole response, or with stream: server-sent events ending `data: [DONE]`",
                "content": {**_json_ref(whole), "text/event-stream": {"schema": event_data}},
            },
            **{
                str(status): _error_response(status)
                for status in statuses
                if status != 401 or security  # a 401 only where a token is asked for
            },
        },
    }


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
            "response_format": {
                "type": ["object", "null"],
                "properties": {"type": {"const": "text"}},
                "description": "only text",
            },
            "best_of": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N, "description": "only n"},
            "stream": flag,
            "stream_options": {"type": ["object", "null"], "properties": {"include_usage": flag}},
            "return_token_ids": {**flag, "description": "token ids beside the text"},
            "priority": {"type": ["integer", "null"], "minimum": -MAX_PRIORITY, "maximum": MAX_PRIORITY},
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
        message = {
            "type": "object",
            "required": ["role"],
            "properties": {"role": {"enum": list(ROLES)}, "content": content},
        }
        properties = {
            "messages": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGES, "items": message},
            "add_generation_prompt": {"type": ["boolean", "null"]},
            "max_completion_tokens": {**self.max_tokens, "description": "default: the tokens left in the context"},
            "max_tokens": {**self.max_tokens, "description": "the older name of max_completion_tokens"},
            "logprobs": {"type": ["boolean", "null"]},
            "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
            **self._shared(),
        }
        return {
            "type": "object",
            "required": ["messages"],
            "properties": properties,
            "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
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
